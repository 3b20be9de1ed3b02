"""Sampling rules and the stop-string detokenizer, each on its own."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from services.inference.device.sampler import filtered_probs, sample, to_host, uniform
from services.inference.engine.detokenizer import Detokenizer
from services.inference.sched.request import SamplingParams
from tests.checkpoints import build_tokenizer


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0]) == [1, 0]


def test_top_k_only_picks_from_the_k_best():
    logits = torch.tensor([[5.0, 4.9, 4.8, 0.0, -1.0]])
    picks = {sample(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert picks == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :]
    picks = collections.Counter(
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0] for s in range(2000)
    )
    assert set(picks) == {0, 1}
    assert abs(picks[0] / 2000 - 0.5 / 0.8) < 0.05


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    counts = collections.Counter(
        sample(probs.log()[None, :], [SamplingParams(temperature=1.0, seed=7)], [i])[0] for i in range(3000)
    )
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 3000 - p) < 0.04


def test_draws_depend_only_on_seed_and_index():
    assert uniform(3, 9) == uniform(3, 9)
    assert len({uniform(3, i) for i in range(100)}) == 100
    assert uniform(3, 9) != uniform(4, 9)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.8, seed=11)] * 4
    batch = sample(logits, params, [5, 5, 5, 5])
    assert batch == [sample(logits[i : i + 1], params[:1], [5])[0] for i in range(4)]


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, seed=2),
    SamplingParams(temperature=1.3, top_k=40, seed=3),
    SamplingParams(temperature=0.5, top_k=10, top_p=0.8, seed=4),
    SamplingParams(temperature=2.0, seed=5),
]


def test_a_seed_draws_the_tokens_it_drew_before_sampling_moved_to_the_host():
    # drawn by the sampler of 3a05106, which sampled each row where its logits were (on the CPU: here)
    before = [
        [393, 1690, 947, 1419, 1770, 569],
        [393, 1441, 1810, 1610, 1770, 1070],
        [393, 3934, 2041, 1388, 1770, 3957],
        [393, 1006, 3835, 1388, 1770, 1848],
        [393, 1006, 1878, 4953, 2895, 3376],
    ]
    torch.manual_seed(0)
    logits = torch.randn(6, 5000) * 3
    assert [sample(logits, MIXED, [i] * 6) for i in range(5)] == before


class DeviceCopies(TorchDispatchMode):
    """Records every op that reads a tensor on a device other than the CPU, and every copy to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.device_ops: list[str] = []
        self.to_host: int = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        if devices - {"cpu"}:
            self.device_ops.append(str(func.overloadpacket))
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.to_host += any(t.device.type == "cpu" for t in outs)
            assert len(devices) == 1 or all(t.numel() <= 1 for t in outs), f"{func} mixes devices {devices}"
        return out


@pytest.mark.parametrize("params, copies", [(MIXED, 2), (MIXED[:1] * 3, 1), (MIXED[1:], 1)])
def test_logits_on_a_cuda_device_come_to_the_host_in_one_sync(params, copies):
    with FakeTensorMode(), DeviceCopies() as seen:  # fake CUDA tensors: shapes and devices, no GPU needed
        logits = torch.empty(len(params), 5000, device="cuda")
        argmax, rows, host = to_host(logits, params)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert argmax.device.type == "cpu" and argmax.shape == (len(params),)
    assert rows == sampled
    assert (host is None) if not sampled else (host.device.type == "cpu" and host.shape == (len(sampled), 5000))
    # the argmax and the sampled rows, each copied once; with no sampled row, the argmax alone; with every row
    # sampled, the rows alone (the device computes no argmax)
    assert seen.to_host == copies, seen.device_ops


def test_the_host_draws_what_sample_draws_from_the_same_logits():
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED), 3000) * 2
    argmax, rows, host = to_host(logits, MIXED)
    assert argmax.tolist() == torch.argmax(logits, -1).tolist() and rows == [1, 2, 3, 4, 5]
    assert torch.equal(host, logits[1:])
    assert sample(logits, MIXED, [3] * 6) == [sample(logits[i : i + 1], MIXED[i : i + 1], [3])[0] for i in range(6)]


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, 1e-8, 1e-3, 1.0, 1e4, 1e30, 3e38])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 1e-9])
@pytest.mark.parametrize("top_k", [0, 1, 50])
def test_every_accepted_temperature_draws_a_token_of_the_vocabulary(temperature, top_p, top_k):
    torch.manual_seed(2)
    logits = torch.randn(3, 2000) * 5
    logits[2, 7] = 40.0  # one row with a clear winner
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=s) for s in range(3)]
    tokens = sample(logits, params, [0, 1, 2])
    assert all(0 <= t < 2000 for t in tokens)
    if temperature <= 1e-8 or top_k == 1 or top_p == 1e-9:  # as good as greedy
        assert tokens == torch.argmax(logits, -1).tolist()


TOKENIZER = build_tokenizer()


def stream(text: str, stop: tuple[str, ...]) -> tuple[list[str], bool]:
    detok = Detokenizer(TOKENIZER, stop)
    pieces = []
    for token in TOKENIZER.encode(text).ids:
        pieces.append(detok.push(token))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    return pieces, detok.stopped


def test_stop_string_cuts_the_text_before_it():
    pieces, stopped = stream("def add(a, b):\n    return a + b\n", ("return",))
    assert stopped and "".join(pieces) == "def add(a, b):\n    "


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    pieces, stopped = stream("for i in range(10):", ("range(99",))
    assert not stopped and "".join(pieces) == "for i in range(10):"


def test_multibyte_characters_are_emitted_whole():
    pieces, _ = stream("Überraschung! 東京 🙂", ())
    assert "".join(pieces) == "Überraschung! 東京 🙂"
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=80, deadline=None)
@given(
    st.text(alphabet="ab c\n", min_size=0, max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
)
def test_stream_is_always_a_prefix_of_the_answer(text, stops):
    pieces, stopped = stream(text, tuple(stops))
    cut, found = len(text), False
    for end in range(1, len(text) + 1):  # read character by character: the first complete stop wins
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            cut, found = end - max(map(len, ending)), True
            break
    assert "".join(pieces) == text[:cut]
    assert stopped == found
    seen = ""
    for piece in pieces:
        seen += piece
        assert text[:cut].startswith(seen)


@pytest.mark.parametrize("scale", [0.1, 8.0])  # flat: the nucleus spans thousands of tokens; peaked: a few
def test_top_p_nucleus_is_the_one_a_full_sort_finds(scale):
    scaled = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * scale
    probs, ids = filtered_probs(scaled, SamplingParams(temperature=1.0, top_p=0.9))
    ref_ids = torch.sort(scaled, descending=True).indices
    ref_probs = torch.softmax(scaled, dim=-1)[ref_ids]
    keep = int(((torch.cumsum(ref_probs, dim=-1) - ref_probs) < 0.9).sum())
    assert ids.tolist() == ref_ids[:keep].tolist()
    assert torch.allclose(probs, ref_probs[:keep], rtol=1e-4)
