"""The CPU kernels that read and write the paged KV cache (decode_attention, rope_cache, decode_layers) against
torch references over gathered blocks: results bit-identical whatever a sequence's blocks, block size and batch
neighbours, and every bad table, length or slot refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from services.inference.device import kernels
from services.inference.device.quant import INT4_GROUP, pack_int4, quantize_int4, quantize_int8
from tests.inference.test_kernels import DTYPES, FEW, num_threads, ops, randn  # noqa: F401 - ops is a fixture

# ---- decode attention over the paged KV cache: [N, KVH, BS, D], a block table a sequence ----


def paged_cache(rows_k, rows_v, lengths, block_size, width, seed, spare=3):
    """Scatters each sequence's rows (rows_k/rows_v [B, KVH, >= length, D], in position order) into shuffled blocks
    of caches [N, KVH, BS, D] -> (k_cache, v_cache, block_tables int64 [B, width]). Every place no sequence's row
    holds is NaN, and each table's entries past its length name blocks that do not exist: neither may be read."""
    batch, kv_heads, _, head_dim = rows_k.shape
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(needed) + spare
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((batch, width), -1)
    tables[:, 1::2] = num_blocks + 1000
    k_cache = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=rows_k.dtype)
    v_cache = k_cache.clone()
    for b, n in enumerate(int(n) for n in lengths):
        for j in range(needed[b]):
            block, rows = free.pop(), min(block_size, n - j * block_size)
            tables[b, j] = block
            k_cache[block, :, :rows] = rows_k[b, :, j * block_size : j * block_size + rows]
            v_cache[block, :, :rows] = rows_v[b, :, j * block_size : j * block_size + rows]
    return k_cache, v_cache, tables


def paged_case(lengths, heads, kv_heads, head_dim, block_size, dtype, seed, width=None):
    """q [B, H, D] and a paged cache holding B random sequences of `lengths` positions."""
    lengths = torch.tensor(lengths)
    width = width or max(1, -(-int(lengths.max()) // block_size))
    q = randn(len(lengths), heads, head_dim, dtype=dtype, seed=seed)
    rows_k = randn(len(lengths), kv_heads, width * block_size, head_dim, dtype=dtype, seed=seed + 1)
    rows_v = randn(len(lengths), kv_heads, width * block_size, head_dim, dtype=dtype, seed=seed + 2)
    return (q, *paged_cache(rows_k, rows_v, lengths, block_size, width, seed), lengths)


def gathered_reference(q, k_cache, v_cache, block_tables, lengths, scale):
    """Plain torch in fp32: each row's blocks gathered in table order, attention over its first lengths[b] rows
    (none: zeros), each kv head serving H / KVH query heads."""
    out = torch.zeros(q.shape)
    block_size, group = k_cache.shape[2], q.shape[1] // k_cache.shape[1]
    for b, n in enumerate(lengths.tolist()):
        if n:
            blocks = block_tables[b, : -(-n // block_size)]
            k, v = (c[blocks].float().transpose(0, 1).flatten(1, 2)[:, :n] for c in (k_cache, v_cache))
            p = torch.softmax(scale * torch.einsum("hd,htd->ht", q[b].float(), k.repeat_interleave(group, 0)), -1)
            out[b] = torch.einsum("ht,htd->hd", p, v.repeat_interleave(group, 0))
    return out


def assert_attention_close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2e-3)


@FEW
@given(
    lengths=st.lists(st.integers(0, 10**6), max_size=4),
    width=st.integers(1, 4),
    block_size=st.sampled_from([16, 32]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from(kernels.DECODE_HEAD_DIMS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_attention_matches_a_reference_over_gathered_blocks(
    ops, lengths, width, block_size, kv_heads, group, head_dim, dtype, seed
):
    """Shuffled blocks, ragged lengths with an empty row and a full table (M * BS), GQA."""
    lengths = [n % (width * block_size + 1) for n in lengths] + [0, width * block_size]
    q, k_cache, v_cache, tables, lengths = paged_case(
        lengths, kv_heads * group, kv_heads, head_dim, block_size, dtype, seed, width
    )
    out = ops.decode_attention(q, k_cache, v_cache, tables, lengths, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out[-2], torch.zeros_like(out[-2]))
    assert_attention_close(out, gathered_reference(q, k_cache, v_cache, tables, lengths, head_dim**-0.5), dtype)


def sdpa_reference(q, k_cache, v_cache, slots, lengths, scale):
    """Masked SDPA over the whole rows of each sequence's slot of a static cache [S, KVH, T, D], in fp32."""
    k, v = k_cache[slots].float(), v_cache[slots].float()  # [B, KVH, T, D]
    mask = torch.arange(k_cache.shape[2])[None, :] < lengths[:, None]  # [B, T]
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


@FEW
@given(
    batch=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from(kernels.DECODE_HEAD_DIMS),
    seq_len=st.sampled_from([16, 32, 48, 80]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_one_block_per_sequence_is_the_static_cache_and_matches_sdpa(
    ops, batch, kv_heads, group, head_dim, seq_len, dtype, seed
):
    """BS = T and block_tables = slots[:, None]: the paged cache is the static [S, KVH, T, D] one of before."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, kv_heads * group, head_dim, dtype=dtype, seed=seed)
    k_cache = randn(batch + 2, kv_heads, seq_len, head_dim, dtype=dtype, seed=seed + 1)
    v_cache = randn(batch + 2, kv_heads, seq_len, head_dim, dtype=dtype, seed=seed + 2)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen)
    out = ops.decode_attention(q, k_cache, v_cache, slots[:, None], lengths, head_dim**-0.5)
    assert_attention_close(out, sdpa_reference(q, k_cache, v_cache, slots, lengths, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_output_is_the_same_whatever_its_blocks_block_size_and_neighbours(ops, dtype):
    """Bit for bit: sequence 0 (150 positions: full and partial blocks, K prefetches 64 rows ahead that cross
    blocks) read from shuffled blocks of 16, 32 or 48 rows or from one block of its own (the static cache), alone
    or after neighbours, on one thread or all."""
    lengths = torch.tensor([150, 3, 97, 0, 160])
    q = randn(5, 9, 64, dtype=dtype, seed=20)
    rows_k, rows_v = randn(5, 3, 160, 64, dtype=dtype, seed=21), randn(5, 3, 160, 64, dtype=dtype, seed=22)
    outputs = []
    for block_size, seed in ((16, 23), (32, 24), (48, 25), (160, 26)):
        k_cache, v_cache, tables = paged_cache(rows_k, rows_v, lengths, block_size, -(-160 // block_size), seed)
        outputs.append(ops.decode_attention(q[:1], k_cache, v_cache, tables[:1], lengths[:1], 0.125)[0])
        order = torch.tensor([4, 2, 0, 1, 3])
        outputs.append(ops.decode_attention(q[order], k_cache, v_cache, tables[order], lengths[order], 0.125)[2])
        with num_threads(1):
            outputs.append(ops.decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)[0])
    assert outputs[0].isfinite().all()
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_is_batch_invariant(ops, dtype):
    q, k_cache, v_cache, tables, lengths = paged_case([90, 17, 0, 64, 33, 81, 5], 9, 3, 64, 16, dtype, seed=13)
    full = ops.decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)
    for b in range(7):
        alone = ops.decode_attention(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lengths[b : b + 1], 0.125)
        assert torch.equal(alone, full[b : b + 1])
    order = torch.tensor([6, 2, 0, 5, 1, 4, 3])
    assert torch.equal(
        ops.decode_attention(q[order], k_cache, v_cache, tables[order], lengths[order], 0.125), full[order]
    )
    with num_threads(1):
        assert torch.equal(ops.decode_attention(q, k_cache, v_cache, tables, lengths, 0.125), full)


def test_decode_attention_reads_a_layer_view_of_a_larger_cache(ops):
    """The executor passes cache[layer]: a view into [layers, N, KVH, BS, D]."""
    q, k_cache, v_cache, tables, lengths = paged_case([20, 40, 7], 4, 2, 32, 16, torch.float32, seed=14)
    k_all, v_all = torch.stack([k_cache * 2, k_cache]), torch.stack([v_cache * 2, v_cache])
    out = ops.decode_attention(q, k_all[1], v_all[1], tables, lengths, 0.2)
    assert torch.equal(out, ops.decode_attention(q, k_cache, v_cache, tables, lengths, 0.2))


def test_decode_attention_rejects_bad_block_tables_lengths_and_block_sizes(ops):
    q, k_cache, v_cache, tables, lengths = paged_case([20, 5], 2, 1, 32, 16, torch.float32, seed=16)
    num_blocks = k_cache.shape[0]  # 2 + 1 + 3 spare
    bad = tables.clone()
    bad[0, 1] = num_blocks
    with pytest.raises(RuntimeError, match=rf"block_tables\[0, 1\]={num_blocks} is outside \[0, {num_blocks}\)"):
        ops.decode_attention(q, k_cache, v_cache, bad, lengths, 1.0)
    bad = tables.clone()
    bad[1, 0] = -1
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 0\]=-1 is outside"):
        ops.decode_attention(q, k_cache, v_cache, bad, lengths, 1.0)
    with pytest.raises(RuntimeError, match=r"lengths\[0\]=33 is outside \[0, 32\]"):
        ops.decode_attention(q, k_cache, v_cache, tables, torch.tensor([33, 1]), 1.0)
    with pytest.raises(RuntimeError, match="block_tables must be int64"):
        ops.decode_attention(q, k_cache, v_cache, tables[:, 0], lengths, 1.0)
    with pytest.raises(RuntimeError, match="block size .* must be a positive multiple of 16, got 8"):
        ops.decode_attention(q, k_cache[:, :, :8], v_cache[:, :, :8], tables, torch.tensor([8, 5]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        ops.decode_attention(q[..., :16], k_cache[..., :16], v_cache[..., :16], tables, lengths, 1.0)


# ---- rope_cache: the rotary embedding and the write into the paged cache ----


def rope_tables(max_len: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    return (torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype), torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))


@pytest.mark.parametrize("block_size", [16, 32, 5])  # rope_cache takes any block size
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cache_writes_exactly_the_rows_slot_mapping_names(ops, dtype, block_size):
    """Rotated at positions[t] (the cos/sin row), written at slot_mapping[t] (block // BS, row % BS): no relation
    between the two, and every other row of the caches left as it was."""
    from services.inference.device.model import apply_rotary

    heads, kv_heads, d, num_blocks = 4, 2, 32, 7
    qkv = randn(20, (heads + 2 * kv_heads) * d, dtype=dtype, seed=40) * 2
    positions = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(41))
    slot_mapping = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(42))[:20]
    cos, sin = rope_tables(64, d, dtype)
    k_cache = torch.full((num_blocks, kv_heads, block_size, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    q = ops.rope_cache(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, heads, kv_heads)
    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(20, -1, d), cos[positions, None], sin[positions, None])
    if dtype == torch.bfloat16:  # rounded as the torch ops round: bit for bit; fp32 may fuse a product into the sum
        assert torch.equal(q, rotated[:, :heads])
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    torch.testing.assert_close(k_cache[blocks, :, rows], rotated[:, heads:], rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[blocks, :, rows], qkv[:, (heads + kv_heads) * d :].view(20, kv_heads, d))
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[blocks, rows] = True
    for cache in (k_cache, v_cache):
        assert cache.transpose(1, 2)[~written].isnan().all() and not cache.transpose(1, 2)[written].isnan().any()


def test_rope_cache_refuses_a_slot_or_position_outside_its_table(ops):
    qkv = randn(4, 4 * 16, dtype=torch.float32, seed=43)
    cos, sin = rope_tables(64, 16, torch.float32)
    k, v = torch.full((3, 1, 16, 16), float("nan")), torch.full((3, 1, 16, 16), float("nan"))
    positions, slot_mapping = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 17, 47, 5])
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 48 is outside \[0, 48\)"):
        ops.rope_cache(qkv, cos, sin, positions, torch.tensor([0, 17, 48, 5]), k, v, 2, 1)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = -1 is outside \[0, 48\)"):
        ops.rope_cache(qkv, cos, sin, positions, torch.tensor([-1, 17, 47, 5]), k, v, 2, 1)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 64 is outside \[0, 64\)"):
        ops.rope_cache(qkv, cos, sin, torch.tensor([0, 64, 2, 3]), slot_mapping, k, v, 2, 1)
    assert k.isnan().all() and v.isnan().all()  # a refused call wrote nothing
    ops.rope_cache(qkv, cos, sin, positions, slot_mapping, k, v, 2, 1)
    assert not k[2, 0, 15].isnan().any()  # slot 47: the last row of the last block


# ---- decode_layers: a step's layers in one op over the paged cache ----


def random_layers(ops, dtype, layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, quant="none"):
    """Per layer 2 norm weights (not ones: a swapped norm would show), 4 packed linears (qkv, o, gate_up, down; int8
    or int4 with their scales if asked) and a qkv bias -> (weights, biases, scales, out_features) as decode_layers
    takes them."""
    out_features = [(heads + 2 * kv_heads) * head_dim, hidden, 2 * intermediate, hidden]
    in_features = [hidden, heads * head_dim, hidden, intermediate]
    weights, biases, scales = [], [], []
    for seed in range(50, 50 + 10 * layers, 10):
        norms = [(1 + 0.2 * randn(hidden, dtype=torch.float32, seed=seed + j)).to(dtype) for j in (0, 1)]
        linears = [
            0.1 * randn(n, k, dtype=dtype, seed=seed + 2 + j) for j, (n, k) in enumerate(zip(out_features, in_features))
        ]
        if quant == "int4":
            packed = [ops.pack_int4(*quantize_int4(w, INT4_GROUP), INT4_GROUP) for w in linears]
            linears, layer_scales = [p for p, _ in packed], [scale for _, scale in packed]
        elif quant == "int8":
            quantized = [quantize_int8(w) for w in linears]
            linears, layer_scales = [ops.pack_int8(q) for q, _ in quantized], [scale for _, scale in quantized]
        else:
            linears, layer_scales = [ops.pack_linear(w) for w in linears], [None] * 4
        qkv, o, gate_up, down = linears
        weights += [norms[0], qkv, o, norms[1], gate_up, down]
        biases += [0.1 * randn(out_features[0], dtype=dtype, seed=seed + 9), None, None, None]
        scales += layer_scales
    return weights, biases, scales, out_features


def layers_one_by_one(ops, x, model, step, k_cache, v_cache, heads, kv_heads, eps, scale):
    """decode_layers' work as the layer-by-layer path calls the kernels, one op at a time in its order; model =
    (weights, biases, scales, out_features), step = (cos, sin, positions, slot_mapping, block_tables, lengths)."""
    (weights, biases, scales, n), (cos, sin, positions, slot_mapping, tables, lengths) = model, step

    def linear(x, w, b, s, n):
        if s is None:
            return ops.linear(x, w, b, n)
        return ops.linear_int8(x, w, s, b, n) if w.dtype == torch.int8 else ops.linear_int4(x, w, s, b, n)

    h, residual = x, None
    for i in range(k_cache.shape[0]):
        w, b, s = weights[6 * i : 6 * i + 6], biases[4 * i : 4 * i + 4], scales[4 * i : 4 * i + 4]
        h, stream = (ops.rms_norm(h, w[0], eps), h) if residual is None else ops.add_rms_norm(h, residual, w[0], eps)
        qkv = linear(h, w[1], b[0], s[0], n[0])
        q = ops.rope_cache(qkv, cos, sin, positions, slot_mapping, k_cache[i], v_cache[i], heads, kv_heads)
        att = ops.decode_attention(q, k_cache[i], v_cache[i], tables, lengths, scale).reshape(len(x), -1)
        h, stream = ops.add_rms_norm(linear(att, w[2], b[1], s[1], n[1]), stream, w[3], eps)
        h, residual = linear(ops.silu_mul(linear(h, w[4], b[2], s[2], n[2])), w[5], b[3], s[3], n[3]), stream
    return h, residual


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layers_over_a_paged_cache_equals_the_layers_one_by_one(ops, dtype, quant):
    """A prompt step (three sequences' chunks: their rows repeat their tables and are causal), then two decode
    steps with ragged lengths: bit-identical to the kernels called layer by layer, caches included, and to the
    same steps on another paging (blocks of 32, other ids); the NaN the caches start with is never read. With int8
    and int4 linears too (their scales passed beside the biases)."""
    model, cos, sin = random_layers(ops, dtype, quant=quant), *rope_tables(64, 32, dtype)
    prompt_lens = torch.tensor([40, 7, 19])
    steps = [(torch.arange(3).repeat_interleave(prompt_lens), torch.cat([torch.arange(n) for n in prompt_lens]))]
    steps += [(torch.arange(3), prompt_lens + k) for k in (0, 1)]  # (each row's sequence, its position)
    outputs = []
    for block_size, seed in ((16, 60), (32, 61)):
        width, num_blocks = 64 // block_size, 3 * 64 // block_size + 2
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: 3 * width].view(3, width)
        shape = (2, num_blocks, 2, block_size, 32)  # [layers, N, KVH, BS, D]
        fused_k, fused_v, k, v = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(4))
        for i, (seqs, positions) in enumerate(steps):
            x = randn(len(seqs), 128, dtype=dtype, seed=70 + i)
            slot_mapping = ids[seqs, positions // block_size] * block_size + positions % block_size
            step = (cos, sin, positions, slot_mapping, ids[seqs], positions + 1)
            fused = ops.decode_layers(x, *model, *step, fused_k, fused_v, 4, 2, 1e-5, 32**-0.5)
            layered = layers_one_by_one(ops, x, model, step, k, v, 4, 2, 1e-5, 32**-0.5)
            assert fused[0].isfinite().all()
            assert torch.equal(fused[0], layered[0]) and torch.equal(fused[1], layered[1])
            assert torch.equal(fused_k.nan_to_num(7.0), k.nan_to_num(7.0))
            assert torch.equal(fused_v.nan_to_num(7.0), v.nan_to_num(7.0))
            outputs.append(fused)
    for by_16, by_32 in zip(outputs[:3], outputs[3:]):
        assert torch.equal(by_16[0], by_32[0]) and torch.equal(by_16[1], by_32[1])


def test_ops_have_fake_implementations_for_torch_compile(ops):
    w = randn(20, 7, dtype=torch.bfloat16, seed=17)
    x = randn(3, 7, dtype=torch.bfloat16, seed=18)
    packed = ops.pack_linear(w)
    q, k_cache, v_cache, tables, lengths = paged_case([8, 20], 4, 2, 32, 16, torch.float32, seed=19)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.zeroqueue.pack_linear.default, (w,), test_utils=checks)
    torch.library.opcheck(torch.ops.zeroqueue.linear.default, (x, packed, None, 20), test_utils=checks)
    torch.library.opcheck(torch.ops.zeroqueue.linear.default, (x, packed, None, 20, ops.bf16_path), test_utils=checks)
    q8, s8 = quantize_int8(w)
    torch.library.opcheck(
        torch.ops.zeroqueue.linear_int8.default, (x, ops.pack_int8(q8), s8, None, 20, ops.bf16_path), test_utils=checks
    )
    for packed4, s4 in (pack_int4(*quantize_int4(w, 4), 4), ops.pack_int4(*quantize_int4(w, 16), 16)):
        torch.library.opcheck(
            torch.ops.zeroqueue.linear_int4.default, (x, packed4, s4, None, 20, ops.bf16_path), test_utils=checks
        )
    torch.library.opcheck(
        torch.ops.zeroqueue.decode_attention.default,
        (q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, lengths, 0.5),
        test_utils=checks,
    )
    torch.library.opcheck(torch.ops.zeroqueue.rms_norm.default, (x, w[0], 1e-5), test_utils=checks)
    torch.library.opcheck(torch.ops.zeroqueue.silu_mul.default, (x[:, :6],), test_utils=checks)
    torch.library.opcheck(torch.ops.zeroqueue.add_rms_norm.default, (x, x * 2, w[0], 1e-5), test_utils=checks)
    # rope_cache's: test_rope_cache.py
