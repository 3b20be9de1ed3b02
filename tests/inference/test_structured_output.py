"""Structured output on the bundled model, through the engine: every call that ends "stop" holds what its
response_format asked for (a JSON value that validates, a whole match, a sentence of the grammar), in every sampling
mode; a constrained call leaves the calls beside it token-for-token as they were; a grammar is compiled once."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from lark import Lark

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.grammar import ConstraintKind, GrammarLimits, make_constraint
from services.inference.sched.request import FinishReason
from tests.inference.conftest import Collector, make_engine, request, run_to_completion

LIMITS = GrammarLimits()
MODES = {  # every sampling mode the sampler has, each seeded
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(temperature=1.2, top_k=8),
    "top_k_top_p": dict(temperature=0.7, top_k=20, top_p=0.8),
}
FORMATS = ("date", "email", "ipv4", "uuid")  # string formats llguidance enforces and jsonschema checks


@pytest.fixture(scope="module")
def engine():
    return make_engine(BUNDLED_MODEL, dtype="bfloat16", max_seq_len=512, max_batch=32)


def prompt_of(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON Schema of the shapes backends send: objects with required and optional fields, arrays, enums,
    nested objects, numbers with bounds, strings with lengths and formats. Sizes stay small, so that most outputs of
    a tiny model end inside max_tokens."""
    choice = rng.choice(
        ["string", "integer", "number", "boolean", "enum", "array", "object", "format"][: 8 - depth * 2]
    )
    if choice == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if choice == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if choice == "number":
        return {"type": "number", "minimum": 0}
    if choice == "boolean":
        return {"type": "boolean"}
    if choice == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "tool", "part", 1, 2, True, None], rng.randint(1, 4))}
    if choice == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if choice == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "qty", "tags", "kind", "meta", "ok", "when"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth) for name in names}
    schema = {"type": "object", "properties": properties, "required": rng.sample(names, rng.randint(0, len(names)))}
    if rng.random() < 0.7:  # a closed object, as structured-output APIs make them
        schema["additionalProperties"] = False
    return schema


def run(engine, calls: list[tuple[str, dict]], max_tokens: int = 160) -> Collector:
    """Runs every (call id, sampling) at once; the engine batches them 32 at a time."""
    out = Collector()
    prompt = prompt_of(engine, "def to_json(record):\n    return ")
    for call_id, sampling in calls:
        engine.add_request(request(call_id, prompt, max_tokens=max_tokens, **sampling), out)
    run_to_completion(engine)
    return out


def test_every_json_schema_call_that_stops_validates(engine):
    rng = random.Random(31)
    schemas = [random_object(rng) for _ in range(200)]
    calls, checks = [], {}
    for i, schema in enumerate(schemas):
        constraint = make_constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), LIMITS)
        for mode in rng.sample(sorted(MODES), 2):  # 2 modes per schema, seeded: each mode about 80 times
            call_id = f"s{i}-{mode}"
            calls.append((call_id, dict(MODES[mode], seed=rng.randrange(1 << 30), constraint=constraint)))
            checks[call_id] = schema
    out = run(engine, calls)
    stopped = 0
    for call_id, schema in checks.items():
        if out.finish_reason(call_id) == FinishReason.STOP:
            stopped += 1
            value = json.loads(out.text(call_id))
            jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        else:  # cut short: only by max_tokens, and said so
            assert out.finish_reason(call_id) == FinishReason.LENGTH
            assert out.outputs[call_id][-1].num_output_tokens == 160
    assert stopped >= 0.6 * len(checks), f"only {stopped} of {len(checks)} calls finished their JSON"


def test_any_json_object_regex_and_grammar_calls_hold_what_they_asked(engine):
    arithmetic = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
    cases = {
        "json": (ConstraintKind.JSON_OBJECT, "", lambda text: isinstance(json.loads(text), dict)),
        "regex": (
            ConstraintKind.REGEX,
            r"[A-Z][a-z]{1,6} [0-9]{2}-[0-9]{4}",
            lambda text: re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}-[0-9]{4}", text) is not None,
        ),
        "lark": (ConstraintKind.LARK_GRAMMAR, arithmetic, lambda text: bool(Lark(arithmetic).parse(text))),
    }
    calls = []
    for name, (kind, source, _) in cases.items():
        constraint = make_constraint(kind, source, LIMITS)
        calls += [(f"{name}-{m}-{s}", dict(MODES[m], seed=s, constraint=constraint)) for m in MODES for s in range(4)]
    out = run(engine, calls, max_tokens=60)
    stopped = 0
    for call_id, _ in calls:
        if out.finish_reason(call_id) == FinishReason.STOP:
            stopped += 1
            assert cases[call_id.split("-")[0]][2](out.text(call_id)), (call_id, out.text(call_id))
    assert stopped >= 0.6 * len(calls)


def test_a_constrained_call_leaves_the_calls_beside_it_as_they_were(engine):
    plain = [(f"p{i}", dict(MODES[m], seed=i)) for i, m in enumerate(sorted(MODES) * 2)]
    alone = run(engine, plain, max_tokens=24)
    constraint = make_constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array", "items": {"type": "integer"}}', LIMITS)
    beside = [(f"c{i}", dict(temperature=1.0, seed=i, constraint=constraint, logprobs=True)) for i in range(6)]
    together = run(engine, plain + beside, max_tokens=24)
    for call_id, _ in plain:
        assert together.tokens(call_id) == alone.tokens(call_id)
        assert together.text(call_id) == alone.text(call_id)
    # and the constrained calls draw the same tokens, whoever shares their batch
    once = run(engine, beside[:1], max_tokens=24)
    assert once.tokens("c0") == together.tokens("c0")


def test_a_grammar_is_compiled_once_and_its_next_call_starts_at_once(engine, monkeypatch):
    from services.inference.engine import grammars as module

    compiles = []
    real = module.compile_matcher
    monkeypatch.setattr(module, "compile_matcher", lambda *a: compiles.append(a[1].key) or real(*a))
    constraint = make_constraint(ConstraintKind.REGEX, "[a-z]{4}compiled-once", LIMITS)
    first = run(engine, [("first", dict(temperature=0.0, constraint=constraint))], max_tokens=20)
    second = engine.grammars.matchers.copy(constraint.key)
    assert second is not None  # cached: the next call takes a copy, no compile
    again = run(engine, [("again", dict(temperature=0.0, constraint=constraint))], max_tokens=20)
    assert compiles == [constraint.key]
    assert first.text("first") == again.text("again") and first.text("first").endswith("compiled-once")


def test_a_call_cancelled_or_expired_while_its_grammar_compiles_ends_alone(engine):
    constraint = make_constraint(ConstraintKind.REGEX, "[0-9]{2}waiting-grammar", LIMITS)
    out = Collector()
    prompt = prompt_of(engine, "x = ")
    engine.add_request(request("cancelled", prompt, max_tokens=10, constraint=constraint), out)
    engine.add_request(request("plain", prompt, max_tokens=10), out)
    engine.cancel("cancelled")
    run_to_completion(engine)
    assert out.finish_reason("cancelled") == FinishReason.CANCELLED and out.tokens("cancelled") == []
    assert out.finish_reason("plain") == FinishReason.LENGTH and len(out.tokens("plain")) == 10
    assert not engine.grammars.waiting
