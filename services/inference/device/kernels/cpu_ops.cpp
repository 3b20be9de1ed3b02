// The zeroqueue CPU ops: schemas only; each kernel registers its CPU implementation in its own file.
// Built twice from the same sources with explicit flags (never -march=native) by __init__.py, for AVX-512 +
// BF16 and for AVX2 + FMA + F16C (-DZQ_AVX2, see simd.h); it loads the one this CPU can run. Shape-only
// (fake) implementations are registered in __init__.py for torch.compile.
#include <torch/library.h>

TORCH_LIBRARY(zeroqueue, m) {
  // w [N, K] -> bf16 / int8 [ceil(N/16), ceil(K/2), 16, 2] or fp32 [ceil(N/16), K, 16], zero-padded (linear.cpp).
  m.def("pack_linear(Tensor w) -> Tensor");
  // x [M, K] . w^T + bias -> [M, n], x and packed of one dtype, fp32 accumulation; bf16_path 0: bf16 widened
  // to fp32 FMAs, 1: VDPBF16PS, 2: AMX tiles where K is a multiple of 32 (which is faster depends on the core:
  // kernels/__init__.py chooses).
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n, int bf16_path=0) -> Tensor");
  // int8 weights (pack_linear of an int8 [N, K]), one fp32 scale per output channel: (x [M, K] . q^T) * scales [n]
  // + bias -> [M, n] in x's dtype, fp32 accumulation; bf16 x multiplies as bf16_path says (linear_int8.cpp).
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n, int bf16_path=0) -> Tensor");
  // int4 weights, symmetric per group of G inputs (quant.pack_int4: packed uint8 [NP, KQ, 16, 2], two weights a
  // byte, four inputs a step; scales fp32 [NP, KQ * 4 / G, 16]): sum over groups of (x . q_g^T) * scales_g + bias -> [M, n] in x's dtype
  // (linear_int4.cpp).
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n, int bf16_path=0) -> Tensor");
  // bf16_dot_rate() -> float and amx_request() -> bool: defined in linear.cpp (no tensor to dispatch on).
  // The KV cache is paged: one layer's caches are [N, KVH, BS, D] (N blocks of BS rows), and position p of a
  // sequence is row p % BS of block table[p / BS] of its block table.
  // q [B, H, D], caches [N, KVH, BS, D] with BS a multiple of 16, block_tables int64 [B, M], lengths int64 [B]
  // (<= M * BS) -> [B, H, D]; row b attends to its positions [0, lengths[b]) (attention.cpp).
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
      "float scale) -> Tensor");
  // x [..., C] -> weight * to_dtype(x * rsqrt(mean(x^2) + eps)) (elementwise.cpp).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // x, residual [..., C] -> (rms_norm(x + residual), x + residual), the sum rounded to the dtype.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  // qkv [T, (H + 2 KVH) D], cos/sin tables [L, D], positions (rotary, < L) and slot_mapping (< N * BS) int64
  // [T], one layer's caches [N, KVH, BS, D] -> rotated q [T, H, D]; writes rotated k and v at
  // [slot_mapping / BS, :, slot_mapping % BS] (rope.cpp).
  m.def(
      "rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int heads, int kv_heads) -> Tensor");
  // gate_up [..., 2I] -> silu(gate) * up [..., I].
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // logits fp32 [R, V] (in place), words int32 [R, W]: every token whose bit is clear becomes -inf; returns each
  // row's argmax after its mask, int64 [R] (mask.cpp).
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor words) -> Tensor");
  // Every decoder layer of a step (layer.cpp): x [T, hidden], 6 weights a layer (input norm, qkv, o,
  // post-attention norm, gate_up, down; linears packed), 4 optional biases a layer and 4 optional scales (those
  // of int8 linears, fp32 [out]; of int4 linears, pack_int4's), out_features of the
  // 4 linears, caches [layers, N, KVH, BS, D], positions/slot_mapping int64 [T], block_tables int64 [T, M]
  // (a row per token row: a prompt chunk's rows repeat their sequence's table), lengths = positions + 1
  // -> (the last layer's MLP output, the residual stream before it), each [T, hidden].
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] scales, int[] out_features, "
      "Tensor cos, Tensor sin, "
      "Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor lengths, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int heads, int kv_heads, float eps, float scale, int bf16_path=0) -> (Tensor, Tensor)");
}
