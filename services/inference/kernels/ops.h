// The kernels that other kernel files call directly (layer.cpp runs a whole decode step's layers without a
// trip through the dispatcher per op). Schemas and shapes: cpu_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace zq {

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                  bool bf16_dot);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slots, at::Tensor& k_cache,
                      at::Tensor& v_cache, int64_t heads, int64_t kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace zq
