// zeroqueue::pack_linear and zeroqueue::linear: y[M, N] = x[M, K] . w[N, K]^T + bias with weights packed
// once into 16-column panels, register-blocked micro-kernels (tile.h, batch invariant), fp32 accumulation.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tile.h"

namespace zq {
namespace {

using namespace tile;

template <class Kn>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  using T = typename Kn::T;
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), steps = packed.size(1);
  const int64_t panel_stride = packed.numel() / np, ldx = steps * Kn::kXPerStep;
  std::vector<typename Kn::X> prepared;
  const typename Kn::X* xf = nullptr;
  if constexpr (std::is_same_v<Kn, F32Weights>) {
    xf = x.data_ptr<float>();
  } else {
    prepared = prepare_rows<Kn>(x.data_ptr<T>(), m, k, ldx);
    xf = prepared.data();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const T* wp = packed.data_ptr<T>();
  const auto panels = [&](int64_t p, int64_t) { return std::pair{wp + p * panel_stride, panel_stride}; };
  run_tiles<Kn, T>(xf, m, ldx, steps, np, panels, nullptr, bias.defined() ? bias.data_ptr<T>() : nullptr,
                   y.data_ptr<T>(), n);
  return y;
}

at::Tensor pack_linear(const at::Tensor& w_in) {
  const at::Tensor w = w_in.contiguous();
  TORCH_CHECK(w.dim() == 2, "pack_linear: w must be [N, K], got ", w.dim(), " dims");
  TORCH_CHECK(w.device().is_cpu(), "pack_linear: w must be on the CPU");
  const int64_t n = w.size(0), k = w.size(1), np = ceil_div(n, kLanes);
  TORCH_CHECK(n > 0 && k > 0, "pack_linear: w must not be empty, got [", n, ", ", k, "]");
  if (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar) {  // int8: linear_int8.cpp
    const int64_t kp = ceil_div(k, 2);
    at::Tensor padded = at::constant_pad_nd(w, {0, 2 * kp - k, 0, np * kLanes - n});
    return padded.view({np, kLanes, kp, 2}).permute({0, 2, 1, 3}).contiguous();  // [NP][KP][16][2]
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat, "pack_linear: w must be bfloat16, float32 or int8, got ",
              w.scalar_type());
  at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, np * kLanes - n});
  return padded.view({np, kLanes, k}).permute({0, 2, 1}).contiguous();  // [NP][K][16]
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                  int64_t bf16_path) {
  TORCH_CHECK(x.dim() == 2, "linear: x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear: x and packed must be on the CPU");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x is ", x.scalar_type(), " but packed is ",
              packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), "linear: packed must be the contiguous output of pack_linear");
  const int64_t k = x.size(1), np = packed.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "linear: x must be bfloat16 or float32");
  const bool shape_ok = bf16 ? packed.dim() == 4 && packed.size(1) == ceil_div(k, 2) && packed.size(2) == kLanes
                             : packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kLanes;
  TORCH_CHECK(shape_ok, "linear: packed ", packed.sizes(), " was not packed for K=", k, " in ", x.scalar_type());
  TORCH_CHECK(n > (np - 1) * kLanes && n <= np * kLanes, "linear: n=", n, " does not match packed with ", np,
              " panels of 16 columns");
  at::Tensor bias_x;  // in x's dtype, as F.linear requires
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear: bias must be [", n, "], got ", bias->sizes());
    bias_x = bias->to(x.scalar_type()).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  if (xc.size(0) == 0) return at::empty({0, n}, x.options());
  if (!bf16) return linear_impl<F32Weights>(xc, packed, bias_x, n);
  TORCH_CHECK(bf16_path >= kBf16Widen && bf16_path <= kBf16Amx, "linear: bf16_path must be 0 (widen), 1 (dot) or 2 "
              "(amx), got ", bf16_path);
  TORCH_CHECK(kHasBf16Dot || bf16_path == kBf16Widen, "linear: bf16_path ", bf16_path, " (dot or amx) needs the "
              "AVX-512 build of the kernels; this AVX2 build has only 0 (widen)");
  // AMX takes k in whole tiles; other shapes take the widening path, whatever M (one path per shape)
  if (bf16_path == kBf16Amx && amx_fits(k)) {
    static const bool amx_ok = amx_request();
    TORCH_CHECK(amx_ok, "linear: this CPU or kernel does not give the process AMX tiles");
    return linear_amx(xc, packed, bias_x, n);
  }
#ifndef ZQ_AVX2
  return bf16_path == kBf16Dot ? linear_impl<Bf16Dot>(xc, packed, bias_x, n)
                               : linear_impl<Bf16Widen>(xc, packed, bias_x, n);
#else
  return linear_impl<Bf16Widen>(xc, packed, bias_x, n);
#endif
}

namespace {

// Issue rate of VDPBF16PS over that of VFMADD231PS on this core (12 independent accumulators each, ~1 ms):
// above 0.5 the dot product does more multiply-adds per second. Rates seen: 1.0 (Zen 4), ~0.25 (an earlier
// host), far enough apart that timing noise does not flip the choice. 0 in the AVX2 build: no VDPBF16PS.
#ifndef ZQ_AVX2
template <class Op>
double issue_seconds(Op op, int64_t iterations) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-9f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n)
    for (int i = 0; i < 12; ++i) acc[i] = op(acc[i]);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  volatile float keep = sink;  // the loops must not be optimised away
  (void)keep;
  return seconds;
}

double bf16_dot_rate() {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1.001f);
  const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)), q = p;
  const auto fma = [&](__m512 c) { return _mm512_fmadd_ps(a, b, c); };
  const auto dot = [&](__m512 c) { return _mm512_dpbf16_ps(c, p, q); };
  double best_fma = 1e9, best_dot = 1e9;
  for (int rep = 0; rep < 3; ++rep) {  // best of 3: a preempted run only makes its side slower
    best_fma = std::min(best_fma, issue_seconds(fma, 50000));
    best_dot = std::min(best_dot, issue_seconds(dot, 50000));
  }
  return best_fma / best_dot;
}
#else
double bf16_dot_rate() { return 0.0; }
#endif

}  // namespace
}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) {
  m.impl("pack_linear", &zq::pack_linear);
  m.impl("linear", &zq::linear);
}

// No tensor to dispatch on: a catch-all kernel, defined with its schema.
TORCH_LIBRARY_FRAGMENT(zeroqueue, m) {
  m.def("bf16_dot_rate() -> float", &zq::bf16_dot_rate);
  m.def("amx_request() -> bool", &zq::amx_request);
}
