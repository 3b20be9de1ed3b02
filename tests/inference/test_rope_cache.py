"""zeroqueue::rope_cache, the rotary embedding and the KV-cache write in one op, against the torch path it
replaces: values, batch invariance, and bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.inference.test_kernels import DTYPES, FEW, ops, randn  # noqa: F401  (ops is a fixture)


def rope_tables(max_len: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    return (torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype), torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))


def rope_case(tokens, heads, kv_heads, head_dim, dtype, seed, blocks=8, block_size=16, max_len=40):
    """Rotary positions below max_len, and distinct cache slots (block * BS + row) of a paged cache
    [blocks, KVH, BS, D] that starts NaN."""
    g = torch.Generator().manual_seed(seed)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed) * 2
    positions = torch.randint(0, max_len, (tokens,), generator=g)
    slot_mapping = torch.randperm(blocks * block_size, generator=g)[:tokens]
    cache = torch.full((blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    return qkv, positions, slot_mapping, cache


def torch_rope_cache(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, heads, kv_heads):
    """The model's torch path: model.apply_rotary on q and k together, then the backend's index_put_."""
    from services.inference.device.model import apply_rotary

    d = k_cache.shape[-1]
    qk = apply_rotary(
        qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
    )
    q, k = qk.split([heads, kv_heads], dim=1)
    blocks, rows = slot_mapping // k_cache.shape[2], slot_mapping % k_cache.shape[2]
    k_cache[blocks, :, rows] = k
    v_cache[blocks, :, rows] = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)
    return q


@FEW
@given(
    tokens=st.integers(1, 12),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from((8, 16, 40, 64, 128)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_cache_matches_the_torch_path(ops, tokens, kv_heads, group, head_dim, dtype, seed):
    heads = kv_heads * group
    qkv, positions, slot_mapping, cache = rope_case(tokens, heads, kv_heads, head_dim, dtype, seed)
    cos, sin = rope_tables(64, head_dim, dtype)
    k_ref, v_ref, k_out, v_out = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    q_ref = torch_rope_cache(qkv, cos, sin, positions, slot_mapping, k_ref, v_ref, heads, kv_heads)
    q = ops.rope_cache(qkv, cos, sin, positions, slot_mapping, k_out, v_out, heads, kv_heads)

    # bf16 rounds each product and the sum as torch does: bit for bit. fp32 may fuse a product into the sum.
    def same(a, b):  # the caches' unwritten places are NaN on both sides
        a, b = a.nan_to_num(7.0), b.nan_to_num(7.0)
        return torch.equal(a, b) if dtype == torch.bfloat16 else torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    assert q.shape == (tokens, heads, head_dim) and same(q, q_ref)
    assert same(k_out, k_ref) and torch.equal(v_out.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    written = torch.zeros(cache.shape[:3], dtype=torch.bool)
    written[slot_mapping // cache.shape[2], :, slot_mapping % cache.shape[2]] = True
    assert not k_out[~written].isfinite().any()  # nothing but [block, :, row] was written


def test_rope_cache_is_batch_invariant(ops):
    # 300 tokens (enough to split across threads) at distinct positions, so none overwrites another's k/v
    qkv, positions, slot_mapping, cache = rope_case(300, 9, 3, 64, torch.bfloat16, seed=30, blocks=32, max_len=512)
    cos, sin = rope_tables(512, 64, torch.bfloat16)
    k_all, v_all = cache.clone(), cache.clone()
    q_all = ops.rope_cache(qkv, cos, sin, positions, slot_mapping, k_all, v_all, 9, 3)
    for t in (0, 150, 299):
        k_one, v_one = cache.clone(), cache.clone()
        q_one = ops.rope_cache(
            qkv[t : t + 1], cos, sin, positions[t : t + 1], slot_mapping[t : t + 1], k_one, v_one, 9, 3
        )
        block, row = slot_mapping[t] // 16, slot_mapping[t] % 16
        assert torch.equal(q_one, q_all[t : t + 1])
        assert torch.equal(k_one[block, :, row], k_all[block, :, row])
        assert torch.equal(v_one[block, :, row], v_all[block, :, row])


def test_rope_cache_refuses_an_index_outside_the_cache(ops):
    qkv, positions, slot_mapping, cache = rope_case(4, 2, 1, 16, torch.float32, seed=40)
    cos, sin = rope_tables(64, 16, torch.float32)
    k, v = cache.clone(), cache.clone()
    with pytest.raises(RuntimeError, match=r"positions\[2\] = 64 is outside \[0, 64\)"):  # the rows of cos/sin
        ops.rope_cache(qkv, cos, sin, torch.tensor([0, 1, 64, 2]), slot_mapping, k, v, 2, 1)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = -1 is outside \[0, 128\)"):
        ops.rope_cache(qkv, cos, sin, positions, torch.tensor([-1, 0, 0, 0]), k, v, 2, 1)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_cache(qkv[:, :-16], cos, sin, positions, slot_mapping, k, v, 2, 1)
    assert k.isnan().all() and v.isnan().all()  # a refused call wrote nothing


def test_rope_cache_has_a_fake_implementation_for_torch_compile(ops):
    qkv, positions, slot_mapping, cache = rope_case(3, 2, 1, 16, torch.float32, seed=41)
    cos, sin = rope_tables(64, 16, torch.float32)
    torch.library.opcheck(
        torch.ops.zeroqueue.rope_cache.default,
        (qkv, cos, sin, positions, slot_mapping, cache.nan_to_num(0.0), cache.nan_to_num(0.0), 2, 1),
        test_utils=("test_schema", "test_faketensor"),
    )
