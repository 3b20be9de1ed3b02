// zeroqueue::pack_linear and zeroqueue::linear: y[M, N] = x[M, K] . w[N, K]^T + bias with weights packed
// once into 16-column panels, register-blocked micro-kernels, fp32 accumulation.
//
// Batch invariance: each output (row, 16 columns) has one accumulator that sees k in ascending order, the
// same instructions whatever M, the tile shape or the thread, and no split-K; a row's result is therefore
// bit-identical in any batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "simd.h"

namespace zq {
namespace {

// A tile keeps kMaxRows x kMaxPanels accumulators (24 of the 32 zmm) in registers, leaving room for the
// widened weights and a broadcast. 3 panels also divide the per-thread share of 960, 576, 3072 and 49152.
constexpr int kMaxRows = 8;
constexpr int kMaxPanels = 3;
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of its loads each panel's stream is prefetched

// ---- weight layouts (see pack_linear) and how one step of a panel widens to fp32 ----
// VDPBF16PS issues at half the rate of VFMADD231PS on this core (measured: ~1.2 vs ~4-5 Gop/s per core),
// so bf16 weights are widened in registers (exact) and multiplied with fp32 FMAs. One code path for
// every M keeps the rounding of a row independent of the batch.

// bf16: [NP][KP][16][2], KP = ceil(K/2). One 64-byte row holds k-pair kk of 16 output columns; lane j is
// the 32-bit pair (w[n0+j][2kk] low half, w[n0+j][2kk+1] high half): a shift widens k=2kk, a mask 2kk+1.
struct Bf16Weights {
  using T = BFloat16;
  static constexpr int kSub = 2;              // k values per step
  static constexpr int64_t kStepElems = 32;   // weight elements per panel per step (64 bytes)
  static __m512 load(const T* p, int u) {
    const __m512i w = _mm512_loadu_si512(p);
    return _mm512_castsi512_ps(u == 0 ? _mm512_slli_epi32(w, 16)
                                      : _mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
};

// fp32: [NP][K][16], one 64-byte row per k.
struct F32Weights {
  using T = float;
  static constexpr int kSub = 1;
  static constexpr int64_t kStepElems = 16;
  static __m512 load(const T* p, int) { return _mm512_loadu_ps(p); }
};

template <typename T>
struct Tile {
  const float* x;        // row 0 of this tile, fp32 [rows][ldx], zero-padded to steps * kSub columns
  int64_t ldx, steps;
  const T* w;            // first panel of this tile
  int64_t panel_stride;  // elements between consecutive panels
  const T* bias;         // [N] at column n0, in x's dtype; nullptr when none
  T* y;                  // [rows][ldy] at column n0
  int64_t ldy, n_left;   // n_left: valid output columns from n0 on
};

// MR rows x NR panels of accumulators live in registers for the whole K loop; each weight row is loaded
// (and widened) once per step and reused by all MR rows; x is broadcast straight from memory.
template <class Kn, int MR, int NR>
void run_tile(const Tile<typename Kn::T>& t) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  constexpr int64_t kAhead = kPrefetchBytes / 64 * Kn::kStepElems;
  for (int64_t s = 0; s < t.steps; ++s) {
    const typename Kn::T* ws = t.w + s * Kn::kStepElems;
    for (int j = 0; j < NR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(ws + j * t.panel_stride + kAhead), _MM_HINT_T0);
    for (int u = 0; u < Kn::kSub; ++u) {  // one k at a time: the MR x NR accumulators stay in registers
      __m512 b[NR];
      for (int j = 0; j < NR; ++j) b[j] = Kn::load(ws + j * t.panel_stride, u);
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(t.x[i * t.ldx + s * Kn::kSub + u]);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const __mmask16 m = first_n(t.n_left - j * kLanes);
    const __m512 b = t.bias ? load16(t.bias + j * kLanes, m) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) store16(t.y + i * t.ldy + j * kLanes, _mm512_add_ps(acc[i][j], b), m);
  }
}

template <class Kn>
using TileFn = void (*)(const Tile<typename Kn::T>&);

// table[nr-1][mr-1] -> run_tile<Kn, mr, nr>, so every tail shape has a register-blocked kernel too.
template <class Kn, int NR, int... Ms>
constexpr std::array<TileFn<Kn>, sizeof...(Ms)> rows_for(std::integer_sequence<int, Ms...>) {
  return {&run_tile<Kn, Ms + 1, NR>...};
}
template <class Kn, int... Ns>
constexpr auto make_table(std::integer_sequence<int, Ns...>) {
  return std::array<std::array<TileFn<Kn>, kMaxRows>, kMaxPanels>{
      rows_for<Kn, Ns + 1>(std::make_integer_sequence<int, kMaxRows>{})...};
}

// x [M, K] bf16 -> fp32 [M, ld], zeros in columns K..ld (an odd K meets the weights' zero padding).
std::vector<float> widen_rows(const BFloat16* x, int64_t m, int64_t k, int64_t ld) {
  std::vector<float> out(m * ld, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; c += kLanes) {
      const __mmask16 mask = first_n(k - c);
      store16(out.data() + r * ld + c, load16(x + r * k + c, mask), mask);
    }
  return out;
}

template <class Kn>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  using T = typename Kn::T;
  static constexpr auto table = make_table<Kn>(std::make_integer_sequence<int, kMaxPanels>{});
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), steps = packed.size(1);
  const int64_t panel_stride = packed.numel() / np, ldx = steps * Kn::kSub;
  std::vector<float> widened;
  const float* xf = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    xf = x.data_ptr<float>();
  } else {
    widened = widen_rows(x.data_ptr<T>(), m, k, ldx);
    xf = widened.data();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const T* wp = packed.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  // Threads split the panels (so each streams its own contiguous part of the weights once); inside a
  // panel group all row blocks run while that group's weights are still in L1/L2.
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += kMaxPanels) {
      const int64_t nr = std::min<int64_t>(kMaxPanels, p1 - p);
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, m - r);
        const Tile<T> t{xf + r * ldx, ldx, steps, wp + p * panel_stride, panel_stride,
                        bp ? bp + p * kLanes : nullptr, yp + r * n + p * kLanes, n, n - p * kLanes};
        table[nr - 1][mr - 1](t);
      }
    }
  });
  return y;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::Tensor pack_linear(const at::Tensor& w_in) {
  const at::Tensor w = w_in.contiguous();
  TORCH_CHECK(w.dim() == 2, "pack_linear: w must be [N, K], got ", w.dim(), " dims");
  TORCH_CHECK(w.device().is_cpu(), "pack_linear: w must be on the CPU");
  const int64_t n = w.size(0), k = w.size(1), np = ceil_div(n, kLanes);
  TORCH_CHECK(n > 0 && k > 0, "pack_linear: w must not be empty, got [", n, ", ", k, "]");
  if (w.scalar_type() == at::kBFloat16) {
    const int64_t kp = ceil_div(k, 2);
    at::Tensor padded = at::constant_pad_nd(w, {0, 2 * kp - k, 0, np * kLanes - n});
    return padded.view({np, kLanes, kp, 2}).permute({0, 2, 1, 3}).contiguous();  // [NP][KP][16][2]
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat, "pack_linear: w must be bfloat16 or float32, got ", w.scalar_type());
  at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, np * kLanes - n});
  return padded.view({np, kLanes, k}).permute({0, 2, 1}).contiguous();  // [NP][K][16]
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
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
  return bf16 ? linear_impl<Bf16Weights>(xc, packed, bias_x, n) : linear_impl<F32Weights>(xc, packed, bias_x, n);
}

}  // namespace
}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) {
  m.impl("pack_linear", &zq::pack_linear);
  m.impl("linear", &zq::linear);
}
