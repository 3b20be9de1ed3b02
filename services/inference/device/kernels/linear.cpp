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
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace zq {
namespace {

// A tile keeps kMaxRows x kMaxPanels accumulators in registers, leaving room for the widened weights and a
// broadcast. AVX-512: 24 of the 32 zmm; 3 panels also divide the per-thread share of 960, 576, 3072 and
// 49152. AVX2: an accumulator is two of the 16 ymm; 2 x 2 keeps 8 of them, 4 weights, a broadcast and the
// pair mask in registers (2 x 3 spilled, 2x slower at M = 8 on Zen 3; 4 x 1 and 6 x 1 lose at M = 1), and
// a single row takes 1 x 3, whose 6 accumulators hide more FMA latency than 1 x 2's 4.
#ifndef ZQ_AVX2
constexpr int kMaxRows = 8;
constexpr int kMaxPanels = 3;
constexpr int kRowsPanels = kMaxPanels;  // panels per tile when M > 1
#else
constexpr int kMaxRows = 2;
constexpr int kMaxPanels = 3;
constexpr int kRowsPanels = 2;  // panels per tile when M > 1
#endif
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of its loads each panel's stream is prefetched

// ---- weight layouts (see pack_linear) and how a tile multiplies one step of them ----
// Each Kn says what x it takes (X: the tile's row type), how many weight elements one step of a panel
// spans, and how a step updates the MR x NR accumulators. One code path for every M keeps the rounding of
// a row independent of the batch.

// bf16: [NP][KP][16][2], KP = ceil(K/2). One 64-byte row holds k-pair kk of 16 output columns; lane j is
// the 32-bit pair (w[n0+j][2kk] low half, w[n0+j][2kk+1] high half).
//
// Bf16Dot: VDPBF16PS multiplies the pair by x's pair (broadcast) and adds both products to the fp32
// accumulator: 32 multiply-adds an instruction. Bf16Widen: the pair widened in registers (exact: a shift,
// a mask) and two fp32 FMAs. Which is faster depends on the core: on the Zen 4 VM of 2026-12-01 both
// instructions issued at 3.6 G/s per core, so the dot product does twice the work; an earlier host issued
// VDPBF16PS at a quarter of the FMA rate. `linear` takes the path kernels/__init__.py measured faster
// on this CPU at load time (ZQ_LINEAR_BF16 overrides it). The AVX2 build has only Bf16Widen.
#ifndef ZQ_AVX2
struct Bf16Dot {
  using T = BFloat16;
  using X = int32_t;                          // x as bf16 pairs, one 32-bit broadcast per step
  static constexpr int64_t kStepElems = 32;   // weight elements per panel per step (64 bytes)
  static constexpr int64_t kXPerStep = 1;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ws + j * panel_stride));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[i * ldx + s]));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
};
#endif

struct Bf16Widen {
  using T = BFloat16;
  using X = float;                            // x widened to fp32, two values per step
  static constexpr int64_t kStepElems = 32;
  static constexpr int64_t kXPerStep = 2;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    for (int u = 0; u < 2; ++u) {  // one k at a time: the MR x NR accumulators stay in registers
      vf b[NR];
      for (int j = 0; j < NR; ++j) b[j] = pair_half(ws + j * panel_stride, u);
      for (int i = 0; i < MR; ++i) {
        const vf a = vset1(x[i * ldx + s * 2 + u]);
        for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(a, b[j], acc[i][j]);
      }
    }
  }
};

// fp32: [NP][K][16], one 64-byte row per k.
struct F32Weights {
  using T = float;
  using X = float;
  static constexpr int64_t kStepElems = 16;
  static constexpr int64_t kXPerStep = 1;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    vf b[NR];
    for (int j = 0; j < NR; ++j) b[j] = load16(ws + j * panel_stride);
    for (int i = 0; i < MR; ++i) {
      const vf a = vset1(x[i * ldx + s]);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(a, b[j], acc[i][j]);
    }
  }
};

template <class Kn>
struct Tile {
  using T = typename Kn::T;
  const typename Kn::X* x;  // row 0 of this tile, [rows][ldx], zero-padded to steps * kXPerStep columns
  int64_t ldx, steps;
  const T* w;            // first panel of this tile
  int64_t panel_stride;  // elements between consecutive panels
  const T* bias;         // [N] at column n0, in x's dtype; nullptr when none
  T* y;                  // [rows][ldy] at column n0
  int64_t ldy, n_left;   // n_left: valid output columns from n0 on
};

// MR rows x NR panels of accumulators live in registers for the whole K loop; each weight row is loaded
// once per step and reused by all MR rows; x is broadcast straight from memory.
template <class Kn, int MR, int NR>
void run_tile(const Tile<Kn>& t) {
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  constexpr int64_t kAhead = kPrefetchBytes / 64 * Kn::kStepElems;
  for (int64_t s = 0; s < t.steps; ++s) {
    const typename Kn::T* ws = t.w + s * Kn::kStepElems;
    for (int j = 0; j < NR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(ws + j * t.panel_stride + kAhead), _MM_HINT_T0);
    Kn::template step<MR, NR>(acc, t.x, t.ldx, s, ws, t.panel_stride);
  }
  for (int j = 0; j < NR; ++j) {
    const mask16 m = first_n(t.n_left - j * kLanes);
    const vf b = t.bias ? load16(t.bias + j * kLanes, m) : vzero();
    for (int i = 0; i < MR; ++i) store16(t.y + i * t.ldy + j * kLanes, vadd(acc[i][j], b), m);
  }
}

template <class Kn>
using TileFn = void (*)(const Tile<Kn>&);

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
      const mask16 mask = first_n(k - c);
      store16(out.data() + r * ld + c, load16(x + r * k + c, mask), mask);
    }
  return out;
}

// x [M, K] bf16 -> [M, ld] bf16 pairs as 32-bit words, a zero after an odd K.
[[maybe_unused]] std::vector<int32_t> pair_rows(const BFloat16* x, int64_t m, int64_t k, int64_t ld) {
  std::vector<int32_t> out(m * ld, 0);
  for (int64_t r = 0; r < m; ++r) std::memcpy(out.data() + r * ld, x + r * k, k * sizeof(BFloat16));
  return out;
}

template <class Kn>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  using T = typename Kn::T;
  static constexpr auto table = make_table<Kn>(std::make_integer_sequence<int, kMaxPanels>{});
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), steps = packed.size(1);
  const int64_t panel_stride = packed.numel() / np, ldx = steps * Kn::kXPerStep;
  std::vector<typename Kn::X> prepared;
  const typename Kn::X* xf = nullptr;
  if constexpr (std::is_same_v<Kn, F32Weights>) {
    xf = x.data_ptr<float>();
  } else {
#ifndef ZQ_AVX2
    if constexpr (std::is_same_v<Kn, Bf16Dot>) prepared = pair_rows(x.data_ptr<T>(), m, k, ldx);
    else prepared = widen_rows(x.data_ptr<T>(), m, k, ldx);
#else
    prepared = widen_rows(x.data_ptr<T>(), m, k, ldx);
#endif
    xf = prepared.data();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const T* wp = packed.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  // Threads split the panels (so each streams its own contiguous part of the weights once); inside a
  // panel group all row blocks run while that group's weights are still in L1/L2.
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    const int64_t group = m == 1 ? kMaxPanels : kRowsPanels;
    for (int64_t p = p0; p < p1; p += group) {
      const int64_t nr = std::min<int64_t>(group, p1 - p);
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, m - r);
        const Tile<Kn> t{xf + r * ldx, ldx, steps, wp + p * panel_stride, panel_stride,
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
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kChar,
              "pack_linear: w must be bfloat16, float32 or int8, got ", w.scalar_type());
  at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, np * kLanes - n});
  return padded.view({np, kLanes, k}).permute({0, 2, 1}).contiguous();  // [NP][K][16] (int8: linear_int8.cpp)
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
