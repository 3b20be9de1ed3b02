"""The CPU kernels' fused elementwise ops (RMSNorm, SiLU-and-mul, the residual add and norm) against torch and
Hugging Face references, and their batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tests.inference.test_kernels import DTYPES, FEW, num_threads, ops, randn  # noqa: F401  (ops is a fixture)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@FEW
@given(rows=st.integers(1, 9), cols=st.integers(1, 200), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rms_norm_matches_hugging_face(ops, rows, cols, dtype, seed):
    x, weight = randn(rows, cols, dtype=dtype, seed=seed) * 3, randn(cols, dtype=dtype, seed=seed + 1)
    out = ops.rms_norm(x, weight, 1e-5)
    ref = hf_rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    # Only the order of the fp32 sum of squares differs; in bf16 that rarely moves a rounding.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(out, ref, **tol)


@FEW
@given(rows=st.integers(1, 9), inter=st.integers(1, 100), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_silu_mul_matches_torch(ops, rows, inter, dtype, seed):
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=seed) * 4
    gate, up = gate_up.split(inter, dim=-1)
    out = ops.silu_mul(gate_up)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(out, F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_are_batch_invariant(ops, dtype):
    # 500 rows: enough for both ops to split rows across threads
    x, weight = randn(500, 576, dtype=dtype, seed=20), randn(576, dtype=dtype, seed=21)
    gate_up = randn(500, 3072, dtype=dtype, seed=22)
    normed, activated = ops.rms_norm(x, weight, 1e-5), ops.silu_mul(gate_up)
    for m in (0, 17, 499):
        assert torch.equal(ops.rms_norm(x[m : m + 1], weight, 1e-5), normed[m : m + 1])
        assert torch.equal(ops.silu_mul(gate_up[m : m + 1]), activated[m : m + 1])
    with num_threads(1):
        assert torch.equal(ops.rms_norm(x, weight, 1e-5), normed)
        assert torch.equal(ops.silu_mul(gate_up), activated)


@FEW
@given(rows=st.integers(1, 9), cols=st.integers(1, 200), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_add_rms_norm_is_the_residual_add_then_the_norm(ops, rows, cols, dtype, seed):
    x, residual = randn(rows, cols, dtype=dtype, seed=seed) * 3, randn(rows, cols, dtype=dtype, seed=seed + 1)
    weight = randn(cols, dtype=dtype, seed=seed + 2)
    normed, total = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # the residual stream, exactly as torch adds it
    assert torch.equal(normed, ops.rms_norm(x + residual, weight, 1e-5))


@FEW
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), extra_words=st.integers(-2, 2), seed=st.integers(0, 2**16))
def test_apply_token_bitmask_bans_exactly_the_clear_bits(ops, rows, vocab, extra_words, seed):
    # a mask of another width than the logits: a tokenizer smaller (words end early: the rest is banned) or larger
    num_words = max((vocab + 31) // 32 + extra_words, 1)
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, num_words), dtype=torch.int32, generator=generator)
    logits = randn(rows, vocab, dtype=torch.float32, seed=seed).round(decimals=1)  # ties: the first one wins
    expected = logits.clone()
    for r in range(rows):
        for token in range(vocab):
            word = token // 32
            if word >= num_words or not (int(words[r, word]) >> (token % 32)) & 1:
                expected[r, token] = float("-inf")
    argmax = ops.apply_token_bitmask(logits, words)
    assert torch.equal(logits, expected)
    assert argmax.tolist() == torch.argmax(expected, dim=1).tolist()  # the first index of the largest, as torch's
