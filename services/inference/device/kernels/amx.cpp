// bf16 linears on AMX tiles (TDPBF16PS: a 16 x 16 fp32 tile += 16 x 32 bf16 rows . 32 x 16 bf16 weights),
// reading pack_linear's bf16 layout as it is: a panel's k-pair rows [KP][16][2] are the tile unit's B layout,
// 16 pair-rows (one 1 KB tile) per 32 values of k.
//
// Batch invariance: every output tile accumulates its k blocks in ascending order with the same instruction,
// whatever M, the tile's row count (M below 16, else 16 with zero padding), the grouping or the thread; a
// row's result is bit-identical in any batch (test_kernels checks it on this path).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "simd.h"

namespace zq {
#ifndef ZQ_AVX2
namespace {

constexpr int kTileRows = 16;
constexpr int64_t kTileK = 32;              // bf16 values of k per tile (64 bytes a row)
constexpr int64_t kTileElems = 16 * 32;     // one B tile of a panel: 16 k-pair rows x 16 columns x 2
constexpr int64_t kAheadTiles = 2;          // how far ahead of its tile loads each panel is prefetched
constexpr int64_t kLdc = 48;                // fp32 columns of the block's output buffer (3 panels)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two layouts of the 8 tiles, every tile 64 bytes wide:
// - M < 16 ("small"): C 0-2 and A 3 of M rows (fewer rows multiply faster; a row's arithmetic is the same
//   whatever the count), B 4-6: one row block against 3 panels, three weight streams in flight as in linear.cpp;
// - M >= 16: C 0-3 (row block r, panel p -> 2r + p), A 4-5, B 6-7, all 16 rows: 2 x 2 tiles, x padded.
TileConfig make_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = (rows < kTileRows && t <= 3) ? rows : kTileRows;
  }
  return cfg;
}

inline void prefetch_tile(const BFloat16* tile) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(tile + line * 32), _MM_HINT_T1);
}

// One row block of M < 16 rows x PB panels over the whole of k -> c [M][kLdc], panel j at column 16 j.
template <int PB>
void small_block(const BFloat16* x, int64_t k, const BFloat16* w, int64_t panel_stride, float* c) {
  _tile_zero(0);
  if constexpr (PB >= 2) _tile_zero(1);
  if constexpr (PB >= 3) _tile_zero(2);
  for (int64_t kb = 0; kb < k / kTileK; ++kb) {
    for (int j = 0; j < PB; ++j) prefetch_tile(w + j * panel_stride + (kb + kAheadTiles) * kTileElems);
    _tile_loadd(3, x + kb * kTileK, k * 2);
    _tile_loadd(4, w + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (PB >= 2) {
      _tile_loadd(5, w + panel_stride + kb * kTileElems, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (PB >= 3) {
      _tile_loadd(6, w + 2 * panel_stride + kb * kTileElems, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, c, kLdc * 4);
  if constexpr (PB >= 2) _tile_stored(1, c + 16, kLdc * 4);
  if constexpr (PB >= 3) _tile_stored(2, c + 32, kLdc * 4);
}

// RB row blocks of 16 x PB panels over the whole of k -> c [RB * 16][kLdc].
template <int RB, int PB>
void large_block(const BFloat16* x, int64_t k, const BFloat16* w, int64_t panel_stride, float* c) {
  _tile_zero(0);
  if constexpr (PB == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && PB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < k / kTileK; ++kb) {
    for (int j = 0; j < PB; ++j) prefetch_tile(w + j * panel_stride + (kb + kAheadTiles) * kTileElems);
    _tile_loadd(4, x + kb * kTileK, k * 2);
    if constexpr (RB == 2) _tile_loadd(5, x + kTileRows * k + kb * kTileK, k * 2);
    _tile_loadd(6, w + kb * kTileElems, 64);
    if constexpr (PB == 2) _tile_loadd(7, w + panel_stride + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RB == 2 && PB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kLdc * 4);
  if constexpr (PB == 2) _tile_stored(1, c + 16, kLdc * 4);
  if constexpr (RB == 2) _tile_stored(2, c + 16 * kLdc, kLdc * 4);
  if constexpr (RB == 2 && PB == 2) _tile_stored(3, c + 16 * kLdc + 16, kLdc * 4);
}

using BlockFn = void (*)(const BFloat16*, int64_t, const BFloat16*, int64_t, float*);
constexpr BlockFn kSmall[3] = {&small_block<1>, &small_block<2>, &small_block<3>};
constexpr BlockFn kLarge[2][2] = {{&large_block<1, 1>, &large_block<1, 2>}, {&large_block<2, 1>, &large_block<2, 2>}};

}  // namespace

bool amx_request() {
  // Linux hands out the 8 KB of tile state only to a process that asks for it (arch_prctl, since 5.16).
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_fits(int64_t k) { return k % kTileK == 0; }

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), panel_stride = packed.numel() / np;
  // M < 16: tiles of M rows; else whole tiles of 16 rows, the padding rows zeros and never stored
  const int tile_rows = m < kTileRows ? int(m) : kTileRows;
  const int64_t rows = (m + tile_rows - 1) / tile_rows * tile_rows;
  at::Tensor xp = x;
  if (rows != m) {
    xp = at::zeros({rows, k}, x.options());
    std::memcpy(xp.data_ptr(), x.data_ptr(), m * k * sizeof(BFloat16));
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const BFloat16* xd = xp.data_ptr<BFloat16>();
  const BFloat16* wp = packed.data_ptr<BFloat16>();
  const BFloat16* bp = bias.defined() ? bias.data_ptr<BFloat16>() : nullptr;
  BFloat16* yp = y.data_ptr<BFloat16>();
  const bool small = tile_rows < kTileRows;
  const int64_t group = small ? 3 : 2;        // panels per block
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    const TileConfig config = make_config(tile_rows);
    _tile_loadconfig(&config);  // per thread: tile configuration is thread state
    alignas(64) float c[2 * kTileRows * kLdc];
    for (int64_t p = p0; p < p1; p += group) {
      const int pb = std::min<int64_t>(group, p1 - p);
      for (int64_t r = 0; r < rows; r += 2 * tile_rows) {
        const int rb = small ? 1 : std::min<int64_t>(2, (rows - r) / tile_rows);
        const BlockFn block = small ? kSmall[pb - 1] : kLarge[rb - 1][pb - 1];
        block(xd + r * k, k, wp + p * panel_stride, panel_stride, c);
        for (int j = 0; j < pb; ++j) {
          const int64_t col = (p + j) * kLanes;
          const __mmask16 mask = first_n(n - col);
          const __m512 b = bp ? load16(bp + col, mask) : _mm512_setzero_ps();
          for (int64_t i = 0; i < std::min<int64_t>(rb * tile_rows, m - r); ++i)
            store16(yp + (r + i) * n + col, _mm512_add_ps(load16(c + i * kLdc + j * 16), b), mask);
        }
      }
    }
    _tile_release();
  });
  return y;
}
#else
// The AVX2 build has no tiles: linear never takes this path there (it rejects bf16_path 2).
bool amx_request() { return false; }
bool amx_fits(int64_t) { return false; }
at::Tensor linear_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "linear: AMX needs the AVX-512 build of the kernels");
  return at::Tensor();
}
#endif

}  // namespace zq
