"""Log-probabilities: from the very distribution the token was drawn from (after the grammar's mask and the
temperature), equal to a plain torch reference on the same logits, and the same whatever shares the batch."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.device.sampler import draw_step
from services.inference.grammar import (
    ConstraintKind,
    GrammarLimits,
    compile_matcher,
    grammar_tokenizer,
    make_constraint,
)
from services.inference.sched.request import SamplingParams
from tests.inference.conftest import Collector, make_engine, request, run_to_completion

LIMITS = GrammarLimits()


def reference(logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax over the whole vocabulary of the logits, masked then scaled (temperature 0: 1), in float64."""
    x = logits.double().clone()
    if allowed is not None:
        x[~allowed] = -math.inf
    return torch.log_softmax(x / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 10, 0.9), (2.0, 0, 0.5)])
def test_logprobs_match_a_torch_reference_and_top_alternatives_sum_to_at_most_one(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 4
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, logprobs=True, top_logprobs=20)
        for s in range(3)
    ]
    draws = draw_step(logits, params, [5, 5, 5])
    for row in range(3):
        ref = reference(logits[row], temperature)
        chosen, top = draws.logprobs[row]
        assert chosen == pytest.approx(float(ref[draws.tokens[row]]), abs=1e-4)
        assert [t for t, _ in top] == torch.topk(ref, 20).indices.tolist()
        assert [v for _, v in top] == pytest.approx(torch.topk(ref, 20).values.tolist(), abs=1e-4)
        assert sum(math.exp(v) for _, v in top) <= 1.0 + 1e-6
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))
        if temperature == 0.0:
            assert draws.tokens[row] == int(torch.argmax(logits[row])) == top[0][0]


def test_a_constrained_rows_logprobs_are_over_what_its_grammar_allows():
    tokenizer = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    grammar = grammar_tokenizer(tokenizer, [0])
    constraint = make_constraint(ConstraintKind.REGEX, "[0-9]+", LIMITS)
    matcher = compile_matcher(grammar, constraint, LIMITS)
    torch.manual_seed(1)
    logits = torch.randn(1, tokenizer.get_vocab_size())
    params = [SamplingParams(temperature=0.9, seed=3, logprobs=True, top_logprobs=5, constraint=constraint)]
    draws = draw_step(logits, params, [0], [matcher])
    chosen, top = draws.logprobs[0]
    assert tokenizer.decode([draws.tokens[0]]).isdigit()
    assert all(tokenizer.decode([t]).isdigit() for t, _ in top)  # no disallowed token is an alternative
    digits = [t for t in range(tokenizer.get_vocab_size()) if tokenizer.decode([t]).isdigit()]
    mask = torch.zeros(tokenizer.get_vocab_size(), dtype=torch.bool)
    mask[digits] = True
    assert chosen == pytest.approx(float(reference(logits[0], 0.9, mask)[draws.tokens[0]]), abs=1e-4)


@pytest.fixture(scope="module")
def engine():
    return make_engine(BUNDLED_MODEL, dtype="bfloat16", max_seq_len=512, max_batch=32)


def test_logprobs_are_the_same_whatever_shares_the_batch(engine):
    prompt = list(engine.tokenizer.encode("def area(r):\n").ids)
    asked = dict(temperature=0.8, seed=11, logprobs=True, top_logprobs=5)
    alone = Collector()
    engine.add_request(request("asked", prompt, max_tokens=16, **asked), alone)
    run_to_completion(engine)
    crowd = Collector()
    for i in range(12):
        other = list(engine.tokenizer.encode(f"class C{i}:\n" * (i % 3 + 1)).ids)
        engine.add_request(request(f"other{i}", other, max_tokens=16 + i, temperature=1.0, seed=i), crowd)
    engine.add_request(request("asked", prompt, max_tokens=16, **asked), crowd)
    run_to_completion(engine)
    lone = [lp for o in alone.outputs["asked"] for lp in o.logprobs]
    shared = [lp for o in crowd.outputs["asked"] for lp in o.logprobs]
    assert len(lone) == len(alone.tokens("asked")) == 16
    assert shared == lone  # bit for bit: the same logits, drawn the same way
    assert all(not o.logprobs for i in range(12) for o in crowd.outputs[f"other{i}"])  # only the calls that asked
