// The kernels that other kernel files call directly (layer.cpp runs a whole decode step's layers without a
// trip through the dispatcher per op). Schemas and shapes: cpu_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace zq {

// bf16_path: how bf16 weights are multiplied (fp32 weights ignore it); one per process, see kernels/__init__.py
constexpr int64_t kBf16Widen = 0, kBf16Dot = 1, kBf16Amx = 2;
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                  int64_t bf16_path);
// int8 weights packed by pack_linear, one fp32 scale per output channel [n] (linear_int8.cpp)
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t bf16_path);
// int4 weights packed by quant.pack_int4 (uint8 [NP, KQ, 16, 2]), fp32 scales per column and group [NP, groups, 16]
// (linear_int4.cpp)
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t bf16_path);
// Paged KV cache: one layer's k_cache/v_cache are [N, KVH, BS, D] (N blocks of BS rows; decode_attention needs
// BS a multiple of 16); position p of a sequence whose block table is `table` is row p % BS of block
// table[p / BS]. A slot_mapping entry s names row s % BS of block s / BS.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lengths, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slot_mapping, at::Tensor& k_cache,
                      at::Tensor& v_cache, int64_t heads, int64_t kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

// AMX (amx.cpp): amx_request asks the OS for the tile state (once a process, before any use); linear_amx takes
// contiguous bf16 x [M, K] with amx_fits(K), packed bf16 weights, bias in bf16 or undefined -> [M, n].
bool amx_request();
bool amx_fits(int64_t k);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n);

}  // namespace zq
