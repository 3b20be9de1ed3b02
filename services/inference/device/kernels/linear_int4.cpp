// zeroqueue::linear_int4: y[M, N] = sum over groups g of (x[M, K_g] . q[N, K_g]^T) * scales[g][N] + bias, with int4
// weights (symmetric, -8..7, one fp32 scale per output column and group of G inputs), in one of two layouts, which the
// packed tensor's last dimension tells apart; scales fp32 [NP][groups][16] for both.
//
// VNNI (quant.pack_int4_vnni, [NP][D][16][4]; both builds): x quantized per row to int8, two steps a 64-byte load,
// the nibbles the unsigned bytes of VPDPBUSD (Int4Vnni) or, on AVX2, VPMADDUBSW (Int4Madd) as they stand. 2.2x / 1.5x
// / 1.8x our bf16 at 1 / 8 / 32 rows on Zen 5 (bench/quant_linear.py, 2026-12-06), where converting was 1.8x / 1.1x /
// 0.9x.
//
// Converting (quant.pack_int4, every build):
//   packed uint8 [NP][KQ][16][2], KQ = groups * G / 4: step t of panel p holds inputs 4t..4t+3 of columns 16p..16p+15,
//   column j's two bytes w[4t] | w[4t+2] << 4 and w[4t+1] | w[4t+3] << 4, each weight + 8 (padding: zero weights).
// A step of a panel is 32 bytes, a quarter of bf16's for the same inputs. tile.h's grouped tiles sum each group's
// products from zero, then add the sum times the group's scale: the integers are exact in bf16 and fp32, so only x
// is rounded.
//
// Every row block turns each step's nibbles into weights in registers, for every M. One vpmovzxbw spreads a step into
// 16-bit words whose low nibbles are the pairs (4t, 4t+1) and high nibbles (4t+2, 4t+3): bf16 x on VDPBF16PS looks
// both up as bf16 pairs (vpermw, one shift); widened x (fp32; bf16 on hosts that widen; the AVX2 build) takes each
// input as fp32 and FMAs. This layout halved the conversion of the first one (a step of one k-pair, 16 bytes, took
// a zero-extension, a shift, an or and a lookup per pair). Converting a panel group once a call into a buffer that
// every row block reads (as linear_int8.cpp does) was slower at 8 and 32 rows on Zen 4: 9.5 and 26 ms against 6.8
// and 22 (bench/quant_linear.py, 2026-12-06). A row meets the same values and instructions whatever M, so its result
// does not depend on its batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <utility>

#include "ops.h"
#include "simd.h"
#include "tile.h"
#include "vnni.h"

namespace zq {
namespace {

using namespace tile;

// A step of a panel: 32 bytes, 4 inputs (k = 4t..4t+3) of 16 columns. As 16-bit words (vpmovzxbw), column j's
// 32-bit lane holds w[4t] | w[4t+2] << 4 in its low word and w[4t+1] | w[4t+3] << 4 in its high word (each + 8).
#ifndef ZQ_AVX2
using Quad = __m512i;
inline Quad load_quad(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
struct Quad {
  __m256i lo, hi;  // columns 0-7, 8-15
};
inline Quad load_quad(const uint8_t* p) {
  return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes)))};
}
#endif

// Input 4t + U of each column as fp32 (exact): the nibble at bit 0, 16, 4 or 20 of the column's lane, minus 8.
template <int U>
inline vf quad_weight(const Quad& v) {
  constexpr int kShift = U == 0 ? 0 : U == 1 ? 16 : U == 2 ? 4 : 20;
#ifndef ZQ_AVX2
  // vpermps reads the low 4 bits of each lane: a 16-entry table of i - 8
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_permutexvar_ps(kShift ? _mm512_srli_epi32(v, kShift) : v, values);
#else
  const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  const auto f = [&](__m256i x) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(x, kShift), m15), eight));
  };
  return {f(v.lo), f(v.hi)};
#endif
}

#ifndef ZQ_AVX2
// bf16 bit patterns of i - 8 for i = 0..15, twice: vpermw reads 5 bits of a word, the fifth another nibble's
alignas(64) constexpr uint16_t kNibbleBf16[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
    0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040,
    0x4080, 0x40A0, 0x40C0, 0x40E0};

// Inputs (4t, 4t+1) (H = 0, the low nibbles) or (4t+2, 4t+3) (H = 1) of each column as bf16 pairs, exact: the pair
// layout VDPBF16PS multiplies with x's pair of the same inputs.
template <int H>
inline __m512bh quad_pairs(const Quad& v) {
  return reinterpret_cast<__m512bh>(
      _mm512_permutexvar_epi16(H ? _mm512_srli_epi16(v, 4) : v, _mm512_load_si512(kNibbleBf16)));
}

struct Int4Dot {
  using T = uint8_t;
  using X = int32_t;  // x as bf16 pairs, two per step
  static constexpr int64_t kStepElems = 2 * kLanes;
  static constexpr int64_t kXPerStep = 2;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    Quad v[NR];
    for (int j = 0; j < NR; ++j) v[j] = load_quad(ws + j * panel_stride);
    half<0>(acc, x, ldx, s, v);
    half<1>(acc, x, ldx, s, v);
  }
  template <int H, int MR, int NR>
  static void half(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const Quad (&v)[NR]) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = quad_pairs<H>(v[j]);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[i * ldx + 2 * s + H]));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
};
#endif

struct Int4Widen {
  using T = uint8_t;
  using X = float;
  static constexpr int64_t kStepElems = 2 * kLanes;
  static constexpr int64_t kXPerStep = 4;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    Quad v[NR];
    for (int j = 0; j < NR; ++j) v[j] = load_quad(ws + j * panel_stride);
    input<0>(acc, x, ldx, s, v);
    input<1>(acc, x, ldx, s, v);
    input<2>(acc, x, ldx, s, v);
    input<3>(acc, x, ldx, s, v);
  }
  template <int U, int MR, int NR>
  static void input(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const Quad (&v)[NR]) {
    vf b[NR];
    for (int j = 0; j < NR; ++j) b[j] = quad_weight<U>(v[j]);
    for (int i = 0; i < MR; ++i) {
      const vf a = vset1(x[i * ldx + 4 * s + U]);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(a, b[j], acc[i][j]);
    }
  }
};

#ifndef ZQ_AVX2
// VNNI: x quantized per row to int8 (vnni.h), the weights in quant.pack_int4_vnni's layout: uint8 [NP][D][16][4],
// D = groups * G / 8; lane j's 4 bytes at double step d hold inputs 8d..8d+3 of column j in their low nibbles and
// 8d+4..8d+7 in their high ones, each weight + 8. One load gives two steps: the low nibbles (an and) and the high
// (a shift and an and) are VPDPBUSD's unsigned bytes as they stand. Each group's products are summed exactly in int32
// from -8 * (the group's sum of q), added to the row's fp32 accumulator times the group's scale per column, and the
// row's factor applied last.
struct Int4Vnni {
  using T = uint8_t;
  using X = int32_t;                                // 4 int8 of x a word, two words per double step
  static constexpr int64_t kStepElems = 4 * kLanes;  // bytes of a double step of a panel
  static constexpr int64_t kXPerStep = 2;
  static constexpr bool kRowScaled = true;
  template <int MR, int NR, class Tl>
  static const float* sum(vf (&out)[MR][NR], const Tl& t) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) out[i][j] = vzero();
    for (int64_t g = 0; g < t.groups; ++g) {
      __m512i part[MR][NR];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) part[i][j] = _mm512_set1_epi32(t.row_offset[i * t.groups + g]);
      const int64_t end = std::min(t.steps, (g + 1) * t.group_steps);
      for (int64_t s = g * t.group_steps; s < end; ++s) {
        prefetch_step<Int4Vnni, typename Tl::Out, NR>(t, s);
        const uint8_t* ws = t.w + s * kStepElems;
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          const __m512i v = _mm512_loadu_si512(ws + j * t.panel_stride);
          const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            vnni::dpbusd(part[i][j], lo, t.x + i * t.ldx + 2 * s);
            vnni::dpbusd(part[i][j], hi, t.x + i * t.ldx + 2 * s + 1);
          }
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const vf f = load16(t.scale + (j * t.groups + g) * kLanes);
        for (int i = 0; i < MR; ++i) out[i][j] = vfmadd(_mm512_cvtepi32_ps(part[i][j]), f, out[i][j]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf f = vset1(t.row_scale[i]);
      for (int j = 0; j < NR; ++j) out[i][j] = _mm512_mul_ps(out[i][j], f);
    }
    return nullptr;
  }
};
using Int4Quads = Int4Vnni;
#else
// The same on AVX2 (vnni.h): per half panel (8 columns, 32 bytes of a double step), VPMADDUBSW multiplies the low
// nibbles by x's first word and the high by its second; the two int16 results (each |.| <= 2 * 15 * 127) are added,
// and VPMADDWD with ones sums them into the 8 int32 lanes. The same int32 sums as VPDPBUSD's, so the same results.
struct Int4Madd {
  using T = uint8_t;
  using X = int32_t;
  static constexpr int64_t kStepElems = 4 * kLanes;
  static constexpr int64_t kXPerStep = 2;
  static constexpr bool kRowScaled = true;
  template <int MR, int NR, class Tl>
  static const float* sum(vf (&out)[MR][NR], const Tl& t) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) out[i][j] = vzero();
    for (int64_t g = 0; g < t.groups; ++g) {
      __m256i part[MR][NR][2];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) part[i][j][0] = part[i][j][1] = _mm256_set1_epi32(t.row_offset[i * t.groups + g]);
      const int64_t end = std::min(t.steps, (g + 1) * t.group_steps);
      for (int64_t s = g * t.group_steps; s < end; ++s) {
        prefetch_step<Int4Madd, typename Tl::Out, NR>(t, s);
        const uint8_t* ws = t.w + s * kStepElems;
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + j * t.panel_stride + 32 * h));
            const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) {
              const int32_t* x = t.x + i * t.ldx + 2 * s;
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[0])),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[1])));
              part[i][j][h] = _mm256_add_epi32(part[i][j][h], _mm256_madd_epi16(p, ones));
            }
          }
      }
      for (int j = 0; j < NR; ++j) {
        const vf f = load16(t.scale + (j * t.groups + g) * kLanes);
        for (int i = 0; i < MR; ++i) {
          const vf sums{_mm256_cvtepi32_ps(part[i][j][0]), _mm256_cvtepi32_ps(part[i][j][1])};
          out[i][j] = vfmadd(sums, f, out[i][j]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const vf f = vset1(t.row_scale[i]);
      for (int j = 0; j < NR; ++j) out[i][j] = vmul(out[i][j], f);
    }
    return nullptr;
  }
};
using Int4Quads = Int4Madd;
#endif

struct Operands {
  const uint8_t* w;
  int64_t np, steps, groups;
  const float* scales;
  at::Tensor bias;  // x's dtype, or undefined
};

// x [m, ldx] as Kn reads it, the nibbles read in registers for every row block
template <class Kn, class Y>
void run_direct(const typename Kn::X* x, int64_t m, int64_t ldx, const Operands& o, at::Tensor& y) {
  const int64_t panel_stride = o.steps * Kn::kStepElems;
  const auto panels = [&](int64_t p, int64_t) { return std::pair{o.w + p * panel_stride, panel_stride}; };
  run_tiles<Kn, Y, true>(x, m, ldx, o.steps, o.np, panels, o.scales, o.bias.defined() ? o.bias.data_ptr<Y>() : nullptr,
                         y.data_ptr<Y>(), y.size(1), o.groups, o.steps / o.groups);
}

template <class Kn, class Y>
void run_widened(const at::Tensor& x, const Operands& o, at::Tensor& y) {
  const int64_t ldx = 4 * o.steps;
  if constexpr (std::is_same_v<Y, float>) {  // zeros past K meet the weights' padding
    const at::Tensor xp = at::constant_pad_nd(x, {0, ldx - x.size(1)}).contiguous();
    return run_direct<Kn, Y>(xp.data_ptr<float>(), x.size(0), ldx, o, y);
  }
  const auto rows = widen_rows(x.data_ptr<BFloat16>(), x.size(0), x.size(1), ldx);
  run_direct<Kn, Y>(rows.data(), x.size(0), ldx, o, y);
}

template <class In>
void run_vnni(const at::Tensor& x, const Operands& o, at::Tensor& y) {
  const int64_t m = x.size(0), panel_stride = o.steps * Int4Quads::kStepElems, group = 8 * o.steps / o.groups;
  const vnni::QuantizedRows rows = vnni::quantize_rows(x.data_ptr<In>(), m, x.size(1), 2 * o.steps, group, 8);
  const auto panels = [&](int64_t p, int64_t) { return std::pair{o.w + p * panel_stride, panel_stride}; };
  run_tiles<Int4Quads, In, true>(rows.words.data(), m, 2 * o.steps, o.steps, o.np, panels, o.scales,
                                 o.bias.defined() ? o.bias.data_ptr<In>() : nullptr, y.data_ptr<In>(), y.size(1),
                                 o.groups, o.steps / o.groups,
                                 RowFactors{rows.offset.data(), rows.scale.data(), rows.groups});
}

}  // namespace

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t bf16_path) {
  TORCH_CHECK(x.dim() == 2, "linear_int4: x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu(),
              "linear_int4: x, packed and scales must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_int4: x must be bfloat16 or float32");
  // pack_int4's [NP, KQ, 16, 2] (steps of 4 inputs), or pack_int4_vnni's [NP, D, 16, 4] (double steps of 8)
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == kLanes && (packed.size(3) == 2 || packed.size(3) == 4),
              "linear_int4: packed must be pack_int4's uint8 [NP, KQ, 16, 2] or pack_int4_vnni's [NP, D, 16, 4], got ",
              packed.sizes());
  const bool quads = packed.size(3) == 4;
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0), steps = packed.size(1), per_step = quads ? 8 : 4;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == np && scales.size(2) == kLanes && scales.size(1) > 0 && steps % scales.size(1) == 0,
              "linear_int4: scales must be fp32 [", np, ", groups, 16] with groups dividing ", steps, ", got ",
              scales.sizes());
  const int64_t groups = scales.size(1), group = per_step * steps / groups;
  TORCH_CHECK(k <= per_step * steps && k > per_step * steps - group, "linear_int4: x has K=", k, " but packed holds ",
              groups, " groups of ", group);
  TORCH_CHECK(!quads || group % kLanes == 0, "linear_int4: VNNI groups must hold a multiple of 16 inputs, not ", group);
  TORCH_CHECK(n > (np - 1) * kLanes && n <= np * kLanes, "linear_int4: n=", n, " does not match ", np, " panels");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "linear_int4: bias must be [", n, "]");
  TORCH_CHECK(bf16_path >= kBf16Widen && bf16_path <= kBf16Amx, "linear_int4: bf16_path must be 0, 1 or 2");
  if (m == 0) return at::empty({0, n}, x.options());
  const Operands o{packed.data_ptr<uint8_t>(), np, steps, groups, scales.data_ptr<float>(),
                   bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor()};
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (quads) {
    if (x.scalar_type() == at::kFloat) run_vnni<float>(xc, o, y);
    else run_vnni<BFloat16>(xc, o, y);
    return y;
  }
  if (x.scalar_type() == at::kFloat) {
    run_widened<Int4Widen, float>(xc, o, y);
    return y;
  }
#ifndef ZQ_AVX2
  if (bf16_path != kBf16Widen) {
    const auto rows = pair_rows(xc.data_ptr<BFloat16>(), m, k, 2 * steps);
    run_direct<Int4Dot, BFloat16>(rows.data(), m, 2 * steps, o, y);
    return y;
  }
#endif
  run_widened<Int4Widen, BFloat16>(xc, o, y);
  return y;
}

}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) { m.impl("linear_int4", &zq::linear_int4); }
