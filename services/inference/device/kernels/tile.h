// The register-blocked tiles of the packed linears (linear.cpp, linear_int8.cpp): weight layouts and how a tile
// multiplies one step of them, the tile kernel and its dispatch table, and the loop that splits a product into
// tiles across threads.
//
// Batch invariance: each output (row, 16 columns) has one accumulator that sees k in ascending order, the
// same instructions whatever M, the tile shape or the thread, and no split-K; a row's result is therefore
// bit-identical in any batch.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace zq {
namespace tile {

// A tile keeps kMaxRows x kMaxPanels accumulators in registers, leaving room for the widened weights and a
// broadcast. AVX-512: 24 of the 32 zmm; 3 panels also divide the per-thread share of 960, 576, 3072 and
// 49152. AVX2: an accumulator is two of the 16 ymm; 2 x 2 keeps 8 of them, 4 weights, a broadcast and the
// pair mask in registers (2 x 3 spilled, 2x slower at M = 8 on Zen 3; 4 x 1 and 6 x 1 lose at M = 1), and
// a single row takes 1 x 3, whose 6 accumulators hide more FMA latency than 1 x 2's 4.
#ifndef ZQ_AVX2
constexpr int kMaxRows = 8;
constexpr int kMaxPanels = 3;
constexpr int kRowsPanels = kMaxPanels;  // panels per tile when M > 1
// Grouped scales (int4) keep a second set of accumulators, the group's running sums: AVX-512 4 rows x 3 panels
// (24 zmm of sums, 3 weights, a broadcast); AVX2 2 x 1.
constexpr int kGroupRows = 4;
constexpr int kGroupPanels = 3;
#else
constexpr int kMaxRows = 2;
constexpr int kMaxPanels = 3;
constexpr int kRowsPanels = 2;  // panels per tile when M > 1
constexpr int kGroupRows = 2;
constexpr int kGroupPanels = 1;
#endif
// How far ahead of its loads each panel's stream is prefetched, into L2. A step at batch 1 on Zen 4 (2 threads,
// 2026-12-06, three alternating rounds): 2 KiB into L2 took 4.1 / 5.2 / 8.3-9.5 ms for int4 / int8 / bf16 against
// 4.6-5.1 / 5.7-6.2 / 9.5-10.1 with 1 KiB into L1: the L1's few outstanding misses held fewer lines in flight than
// a stream needs. 4 KiB was no better than 2.
constexpr int64_t kPrefetchBytes = 2048;

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

// Y: the dtype of y and the bias (the weights' dtype for bf16 and fp32 weights; x's for int8 weights, whose
// products run on bf16 copies of the integers, see linear_int8.cpp).
template <class Kn, class Y = typename Kn::T>
struct Tile {
  using T = typename Kn::T;
  using Out = Y;
  const typename Kn::X* x;  // row 0 of this tile, [rows][ldx], zero-padded to steps * kXPerStep columns
  int64_t ldx, steps;
  const T* w;            // first panel of this tile
  int64_t panel_stride;  // elements between consecutive panels
  // one factor per output column after the K loop ([N] at column n0), or per column and group of group_steps
  // steps ([panels][groups][16] at panel n0 / 16, run_group_tile); nullptr when none
  const float* scale;
  const Y* bias;         // [N] at column n0; nullptr when none
  Y* y;                  // [rows][ldy] at column n0
  int64_t ldy, n_left;   // n_left: valid output columns from n0 on
  int64_t groups = 1, group_steps = 0;  // grouped scales: groups per panel, steps per group
  // a row-scaled Kn's (row_scaled_v): each row's integer starts ([rows][groups] where grouped, else [rows]) and
  // factor ([rows]), from this tile's row 0
  const int32_t* row_offset = nullptr;
  const float* row_scale = nullptr;
};

// A row-scaled Kn (Int8Vnni, Int4Vnni) sums integers: Kn::sum runs the K loop on accumulators that start at the row's
// offsets, gives them as floats times the row's factor, and returns the column scale still to apply (or nullptr).
template <class Kn, class = void>
struct row_scaled : std::false_type {};
template <class Kn>
struct row_scaled<Kn, std::void_t<decltype(Kn::kRowScaled)>> : std::bool_constant<Kn::kRowScaled> {};
template <class Kn>
constexpr bool row_scaled_v = row_scaled<Kn>::value;

// y = acc (* scale, one factor per column) + bias, for MR rows x NR panels
template <class Kn, class Y, int MR, int NR>
void store_tile(const vf (&acc)[MR][NR], const Tile<Kn, Y>& t, const float* scale) {
  for (int j = 0; j < NR; ++j) {
    const mask16 m = first_n(t.n_left - j * kLanes);
    const vf b = t.bias ? load16(t.bias + j * kLanes, m) : vzero();
    if (scale) {
      const vf s = load16(scale + j * kLanes, m);
      for (int i = 0; i < MR; ++i) store16(t.y + i * t.ldy + j * kLanes, vfmadd(acc[i][j], s, b), m);
    } else {
      for (int i = 0; i < MR; ++i) store16(t.y + i * t.ldy + j * kLanes, vadd(acc[i][j], b), m);
    }
  }
}

template <class Kn, class Y, int NR>
inline void prefetch_step(const Tile<Kn, Y>& t, int64_t s) {
  constexpr int64_t kAhead = kPrefetchBytes / 64 * Kn::kStepElems;
  for (int j = 0; j < NR; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(t.w + s * Kn::kStepElems + j * t.panel_stride + kAhead), _MM_HINT_T1);
}

// MR rows x NR panels of accumulators live in registers for the whole K loop; each weight row is loaded
// once per step and reused by all MR rows; x is broadcast straight from memory.
template <class Kn, class Y, int MR, int NR>
void run_tile(const Tile<Kn, Y>& t) {
  vf acc[MR][NR];
  if constexpr (row_scaled_v<Kn>) {
    // its own integer accumulators, kept apart from vf so they stay in registers; it says which column scale is left
    return store_tile(acc, t, Kn::template sum<MR, NR>(acc, t));
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
    for (int64_t s = 0; s < t.steps; ++s) {
      prefetch_step<Kn, Y, NR>(t, s);
      Kn::template step<MR, NR>(acc, t.x, t.ldx, s, t.w + s * Kn::kStepElems, t.panel_stride);
    }
  }
  store_tile(acc, t, t.scale);
}

// Grouped scales: each group's products are summed apart from zero, then added to the row's accumulator times the
// group's factor per column, in ascending k as run_tile (so a row's result is still the same in any batch).
template <class Kn, class Y, int MR, int NR>
void run_group_tile(const Tile<Kn, Y>& t) {
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  for (int64_t g = 0; g < t.groups; ++g) {
    vf part[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i][j] = vzero();
    const int64_t end = std::min(t.steps, (g + 1) * t.group_steps);
    for (int64_t s = g * t.group_steps; s < end; ++s) {
      prefetch_step<Kn, Y, NR>(t, s);
      Kn::template step<MR, NR>(part, t.x, t.ldx, s, t.w + s * Kn::kStepElems, t.panel_stride);
    }
    for (int j = 0; j < NR; ++j) {
      const vf f = load16(t.scale + (j * t.groups + g) * kLanes);
      for (int i = 0; i < MR; ++i) acc[i][j] = vfmadd(part[i][j], f, acc[i][j]);
    }
  }
  store_tile(acc, t, nullptr);
}

template <class Kn, class Y>
using TileFn = void (*)(const Tile<Kn, Y>&);

template <class Kn, class Y, bool Grouped, int MR, int NR>
constexpr TileFn<Kn, Y> tile_fn() {
  if constexpr (Grouped && !row_scaled_v<Kn>) return &run_group_tile<Kn, Y, MR, NR>;  // a row-scaled Kn groups itself
  else return &run_tile<Kn, Y, MR, NR>;
}

// table[nr-1][mr-1] -> the tile of mr rows x nr panels, so every tail shape has a register-blocked kernel too.
template <class Kn, class Y, bool Grouped, int NR, int... Ms>
constexpr std::array<TileFn<Kn, Y>, sizeof...(Ms)> rows_for(std::integer_sequence<int, Ms...>) {
  return {tile_fn<Kn, Y, Grouped, Ms + 1, NR>()...};
}
template <class Kn, class Y, bool Grouped, int Rows, int... Ns>
constexpr auto make_table(std::integer_sequence<int, Ns...>) {
  return std::array<std::array<TileFn<Kn, Y>, Rows>, sizeof...(Ns)>{
      rows_for<Kn, Y, Grouped, Ns + 1>(std::make_integer_sequence<int, Rows>{})...};
}

// Every tile of y [m, n] = x . w^T (* scale) + bias. Threads split the np panels, so each streams its own
// contiguous part of the weights once; `panels(p, nr)` gives a group of nr panels from panel p as (first panel,
// elements between panels), and every row block runs while that group is still in L1/L2. Grouped: scales grouped
// along K (run_group_tile), `groups` of group_steps steps each; else one factor per column, or none.
// Row-scaled Kn: rows gives each row's offsets and factor.
struct RowFactors {
  const int32_t* offset = nullptr;  // [m][offsets_per_row]
  const float* scale = nullptr;
  int64_t offsets_per_row = 1;
};

template <class Kn, class Y, bool Grouped = false, class Panels>
void run_tiles(const typename Kn::X* x, int64_t m, int64_t ldx, int64_t steps, int64_t np, const Panels& panels,
               const float* scale, const Y* bias, Y* y, int64_t n, int64_t groups = 1, int64_t group_steps = 0,
               RowFactors rows = {}) {
  constexpr int kRows = Grouped ? kGroupRows : kMaxRows;
  static constexpr auto table =
      make_table<Kn, Y, Grouped, kRows>(std::make_integer_sequence<int, Grouped ? kGroupPanels : kMaxPanels>{});
  const int64_t group = Grouped ? kGroupPanels : m == 1 ? kMaxPanels : kRowsPanels;
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += group) {
      const int64_t nr = std::min<int64_t>(group, p1 - p);
      const auto [w, panel_stride] = panels(p, nr);
      for (int64_t r = 0; r < m; r += kRows) {
        const int64_t mr = std::min<int64_t>(kRows, m - r);
        const Tile<Kn, Y> t{x + r * ldx, ldx, steps, w, panel_stride, scale ? scale + p * kLanes * groups : nullptr,
                            bias ? bias + p * kLanes : nullptr, y + r * n + p * kLanes, n, n - p * kLanes,
                            groups, group_steps, rows.offset ? rows.offset + r * rows.offsets_per_row : nullptr,
                            rows.scale ? rows.scale + r : nullptr};
        table[nr - 1][mr - 1](t);
      }
    }
  });
}

// x [M, K] bf16 -> fp32 [M, ld], zeros in columns K..ld (an odd K meets the weights' zero padding).
inline std::vector<float> widen_rows(const BFloat16* x, int64_t m, int64_t k, int64_t ld) {
  std::vector<float> out(m * ld, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; c += kLanes) {
      const mask16 mask = first_n(k - c);
      store16(out.data() + r * ld + c, load16(x + r * k + c, mask), mask);
    }
  return out;
}

// x [M, K] bf16 -> [M, ld] bf16 pairs as 32-bit words, a zero after an odd K.
inline std::vector<int32_t> pair_rows(const BFloat16* x, int64_t m, int64_t k, int64_t ld) {
  std::vector<int32_t> out(m * ld, 0);
  for (int64_t r = 0; r < m; ++r) std::memcpy(out.data() + r * ld, x + r * k, k * sizeof(BFloat16));
  return out;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// bf16 x [M, K] as the tile kernel Kn reads it: [M, ldx], zero-padded
template <class Kn>
std::vector<typename Kn::X> prepare_rows(const BFloat16* x, int64_t m, int64_t k, int64_t ldx) {
#ifndef ZQ_AVX2
  if constexpr (std::is_same_v<Kn, Bf16Dot>) return pair_rows(x, m, k, ldx);
  else return widen_rows(x, m, k, ldx);
#else
  return widen_rows(x, m, k, ldx);
#endif
}

}  // namespace tile
}  // namespace zq
