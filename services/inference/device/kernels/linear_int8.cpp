// zeroqueue::linear_int8: y[M, N] = (x[M, K] . q[N, K]^T) * scale[N] + bias with int8 weights (symmetric, one
// fp32 scale per output channel), packed by pack_linear into 16-column panels [NP][K][16], fp32 accumulation.
// Issue 34's first int8 kernel, measured by bench/quant_linear.py before the executor uses it.
//
// A weight row of a panel (16 int8, 16 bytes) is widened to fp32 once a step and used by every row of the tile;
// the scale is applied once, after the K loop. Batch invariance as linear.cpp: one accumulator per output sees k
// in ascending order with the same instructions whatever M, the tile or the thread.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

#include "simd.h"

namespace zq {
namespace {

constexpr int kRows = 8;                // rows of a tile (the accumulators: kRows x kPanels vf)
#ifndef ZQ_AVX2
constexpr int kPanels = 3;
#else
constexpr int kPanels = 1;              // AVX2: a vf is two ymm, and 16 ymm hold 8 x 1 accumulators at most
#endif
constexpr int64_t kPrefetchSteps = 64;  // 1 KiB ahead of each panel's stream

// 16 int8 -> 16 fp32 lanes (exact)
inline vf widen_int8(const int8_t* p) {
#ifndef ZQ_AVX2
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
#endif
}

// X: how x is read (a broadcast per row and step); T: the dtype of y and the bias (bf16 or fp32)
template <class X, class T>
struct Int8Tile {
  const X* x;  // row 0 of the tile, [rows][k]
  int64_t k;
  const int8_t* w;        // the tile's first panel
  int64_t panel_stride;   // bytes between panels (k * 16)
  const float* scale;     // [n] at column n0
  const T* bias;          // [n] at column n0, or nullptr
  T* y;                   // [rows][ldy] at column n0
  int64_t ldy, n_left;
};

template <class X, class T, int MR, int NR>
void run_tile(const Int8Tile<X, T>& t) {
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  for (int64_t s = 0; s < t.k; ++s) {
    const int8_t* ws = t.w + s * kLanes;
    vf b[NR];
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(ws + j * t.panel_stride + kPrefetchSteps * kLanes), _MM_HINT_T0);
      b[j] = widen_int8(ws + j * t.panel_stride);
    }
    for (int i = 0; i < MR; ++i) {
      const vf a = vset1(static_cast<float>(t.x[i * t.k + s]));
      for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(a, b[j], acc[i][j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const mask16 m = first_n(t.n_left - j * kLanes);
    const vf scale = load16(t.scale + j * kLanes, m), bias = t.bias ? load16(t.bias + j * kLanes, m) : vzero();
    for (int i = 0; i < MR; ++i) store16(t.y + i * t.ldy + j * kLanes, vfmadd(acc[i][j], scale, bias), m);
  }
}

template <class X, class T>
using TileFn = void (*)(const Int8Tile<X, T>&);
template <class X, class T, int NR, int... Ms>
constexpr std::array<TileFn<X, T>, sizeof...(Ms)> rows_for(std::integer_sequence<int, Ms...>) {
  return {&run_tile<X, T, Ms + 1, NR>...};
}
template <class X, class T, int... Ns>
constexpr auto make_table(std::integer_sequence<int, Ns...>) {
  return std::array<std::array<TileFn<X, T>, kRows>, kPanels>{
      rows_for<X, T, Ns + 1>(std::make_integer_sequence<int, kRows>{})...};
}

// x of dtype X (fp32, or bf16 read in place), y and bias of dtype T
template <class X, class T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& bias,
         at::Tensor& y) {
  static constexpr auto table = make_table<X, T>(std::make_integer_sequence<int, kPanels>{});
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1), np = packed.size(0), panel_stride = k * kLanes;
  const X* xp = x.data_ptr<X>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  // threads split the panels, so each streams its own part of the weights once (as linear.cpp)
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += kPanels) {
      const int64_t nr = std::min<int64_t>(kPanels, p1 - p);
      for (int64_t r = 0; r < m; r += kRows) {
        const int64_t mr = std::min<int64_t>(kRows, m - r);
        const Int8Tile<X, T> t{xp + r * k, k, wp + p * panel_stride, panel_stride, sp + p * kLanes,
                               bp ? bp + p * kLanes : nullptr, yp + r * n + p * kLanes, n, n - p * kLanes};
        table[nr - 1][mr - 1](t);
      }
    }
  });
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "linear_int8: x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_int8: x and packed must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_int8: x must be bfloat16 or float32");
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == k && packed.size(2) == kLanes,
              "linear_int8: packed ", packed.sizes(), " is not pack_linear's int8 output for K=", k);
  TORCH_CHECK(n > (np - 1) * kLanes && n <= np * kLanes, "linear_int8: n=", n, " does not match ", np, " panels");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "linear_int8: scales must be [", n, "]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "linear_int8: bias must be [", n, "]");
  if (m == 0) return at::empty({0, n}, x.options());
  const at::Tensor xc = x.contiguous(), sc = scales.to(at::kFloat).contiguous();
  const at::Tensor bc = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
  // bf16 x: one row is read in place; more rows are widened once (exact), so each row's broadcast is a load,
  // not a conversion per tile: the same values either way, so a row's result does not depend on its batch
  if (x.scalar_type() == at::kFloat) run<float, float>(xc, packed, sc, bc, y);
  else if (m == 1) run<BFloat16, BFloat16>(xc, packed, sc, bc, y);
  else run<float, BFloat16>(xc.to(at::kFloat), packed, sc, bc, y);
  return y;
}

}  // namespace
}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) { m.impl("linear_int8", &zq::linear_int8); }
