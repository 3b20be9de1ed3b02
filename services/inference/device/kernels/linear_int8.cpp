// zeroqueue::linear_int8: y[M, N] = (x[M, K] . q[N, K]^T) * scale[N] + bias with int8 weights (symmetric, one fp32
// scale per output channel), in one of two layouts, which the packed tensor's shape tells apart:
//
// Quads ([NP][KQ][16][4], quant.pack_int8_vnni; both builds): x is quantized per row to int8 at the call and the
// products are summed exactly in int32 by VPDPBUSD (Int8Vnni, below; on AVX2 VPMADDUBSW and VPMADDWD, Int8Madd),
// then scaled by the row's and the column's factor. Twice VDPBF16PS's multiply-adds an instruction and nothing to
// convert: 1.65x our bf16 at 1-32 rows.
//
// Pairs ([NP][KP][16][2], pack_linear's bf16 layout; every build): up to kDirectRows rows, every row block converts
// each step of the panels to bf16 in registers (exact: |q| <= 127 has 7 significant bits, bf16 8). Above, each
// thread turns one group of panels at a time into bf16 in a buffer of its own that stays in L2, then runs tile.h's
// bf16 tiles over it for every row block, so a weight is converted once a call, not once a row block. Either way the
// scale is applied after the K loop. bf16 x: VDPBF16PS or widened FMAs as bf16_path says (AMX hosts take VDPBF16PS:
// the AMX kernel reads another layout); fp32 x: widened FMAs, the fp32 products exactly.
//
// Batch invariant as tile.h: a row meets the same values and instructions whatever M (and VNNI quantizes each row
// on its own).
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tile.h"
#include "vnni.h"

namespace zq {
namespace {

using namespace tile;

constexpr int64_t kPairStep = 2 * kLanes;  // elements of one step of a panel: 16 columns x a k-pair

// 16 int8 -> 16 fp32 lanes (exact)
inline vf widen_int8(const int8_t* p) {
#ifndef ZQ_AVX2
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
#endif
}

#ifndef ZQ_AVX2
// One step of an int8 panel (32 bytes) -> the same 32 values as bf16, in place (cvtne2ps puts its second operand
// in the low half)
inline __m512bh to_bf16_pairs(const int8_t* p) { return _mm512_cvtne2ps_pbh(widen_int8(p + kLanes), widen_int8(p)); }
#endif

// One step of an int8 panel, 16 columns x a k-pair (32 bytes, lane j's pair at bytes 2j, 2j + 1) -> the first (u0)
// and second (u1) element of each pair as fp32, exact.
inline void int8_pairs(const int8_t* p, vf& u0, vf& u1) {
#ifndef ZQ_AVX2
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // 32-bit lanes
  u0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16));
  u1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16));
#else
  const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kLanes)));
  u0 = {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16)),
        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(hi, 16), 16))};
  u1 = {_mm256_cvtepi32_ps(_mm256_srai_epi32(lo, 16)), _mm256_cvtepi32_ps(_mm256_srai_epi32(hi, 16))};
#endif
}

// The tile kernels that read int8 panels directly, converting each step in registers: what batches of up to
// kDirectRows run. Each does exactly what its bf16 counterpart
// does on the converted values (Int8Widen: Bf16Widen's FMAs; Int8Dot: Bf16Dot's VDPBF16PS), so a row's result is the
// same whether its batch took this path or the buffer's.
struct Int8Widen {
  using T = int8_t;
  using X = float;
  static constexpr int64_t kStepElems = kPairStep;
  static constexpr int64_t kXPerStep = 2;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    vf b[2][NR];
    for (int j = 0; j < NR; ++j) int8_pairs(ws + j * panel_stride, b[0][j], b[1][j]);
    for (int u = 0; u < 2; ++u) {
      for (int i = 0; i < MR; ++i) {
        const vf a = vset1(x[i * ldx + s * 2 + u]);
        for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(a, b[u][j], acc[i][j]);
      }
    }
  }
};

#ifndef ZQ_AVX2
struct Int8Dot {
  using T = int8_t;
  using X = int32_t;
  static constexpr int64_t kStepElems = kPairStep;
  static constexpr int64_t kXPerStep = 1;
  template <int MR, int NR>
  static void step(vf (&acc)[MR][NR], const X* x, int64_t ldx, int64_t s, const T* ws, int64_t panel_stride) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) b[j] = to_bf16_pairs(ws + j * panel_stride);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[i * ldx + s]));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
};


// VNNI (AVX-512 VNNI's VPDPBUSD): x quantized per row to int8 at the call (symmetric, q = round(x * 127 / amax),
// its factor amax / 127), the weights in quads, [NP][KQ][16][4] (KQ = ceil(K/4); lane j's 4 bytes are w[n0+j][4kq..
// 4kq+3]), each stored as q + 128, VPDPBUSD's unsigned operand. One instruction multiplies 4 inputs of 16 columns and
// adds them to int32 sums, exactly: twice VDPBF16PS's work and no conversion of the weights. A row's sum starts at
// -128 * sum(its q) to take the + 128 back out, then is scaled by the row's factor and the column's.
struct Int8Vnni {
  using T = int8_t;
  using X = int32_t;  // 4 int8 of x a word, one broadcast per step
  static constexpr int64_t kStepElems = 4 * kLanes;
  static constexpr int64_t kXPerStep = 1;
  static constexpr bool kRowScaled = true;
  static constexpr int32_t kBiasUnit = 128;  // what the stored bytes add to q (quantize_rows takes it out)
  template <int MR, int NR, class Tl>
  static const float* sum(vf (&out)[MR][NR], const Tl& t) {
    __m512i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_set1_epi32(t.row_offset[i]);
    for (int64_t s = 0; s < t.steps; ++s) {
      prefetch_step<Int8Vnni, typename Tl::Out, NR>(t, s);
      const int8_t* ws = t.w + s * kStepElems;
      __m512i b[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(ws + j * t.panel_stride);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i a = _mm512_set1_epi32(t.x[i * t.ldx + s]);
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) vnni::dpbusd(acc[i][j], b[j], a);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vf f = vset1(t.row_scale[i]);
      for (int j = 0; j < NR; ++j) out[i][j] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), f);
    }
    return t.scale;
  }
};

using Int8Quads = Int8Vnni;
#else
// The same quads on AVX2 (vnni.h): VPMADDUBSW's unsigned operand is |w| (the stored byte ^ 0x80 is w; |-128| is 128
// as an unsigned byte) and its signed one x with w's sign (|q| <= 127, so it cannot overflow). A pair of products is
// then at most 2 * 128 * 127, inside int16; VPMADDWD with ones sums the pairs into int32.
struct Int8Madd {
  using T = int8_t;
  using X = int32_t;
  static constexpr int64_t kStepElems = 4 * kLanes;
  static constexpr int64_t kXPerStep = 1;
  static constexpr bool kRowScaled = true;
  static constexpr int32_t kBiasUnit = 0;  // it reads |q| and q's sign, not the stored q + 128
  template <int MR, int NR, class Tl>
  static const float* sum(vf (&out)[MR][NR], const Tl& t) {
    const __m256i flip = _mm256_set1_epi8(-128), ones = _mm256_set1_epi16(1);
    __m256i acc[MR][NR][2];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_set1_epi32(t.row_offset[i]);
    for (int64_t s = 0; s < t.steps; ++s) {
      prefetch_step<Int8Madd, typename Tl::Out, NR>(t, s);
      const int8_t* ws = t.w + s * kStepElems;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + j * t.panel_stride + 32 * h)), flip);
          const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(t.x[i * t.ldx + s]), w);
            acc[i][j][h] = _mm256_add_epi32(acc[i][j][h], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones));
          }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf f = vset1(t.row_scale[i]);
      for (int j = 0; j < NR; ++j)
        out[i][j] = vmul(vf{_mm256_cvtepi32_ps(acc[i][j][0]), _mm256_cvtepi32_ps(acc[i][j][1])}, f);
    }
    return t.scale;
  }
};
using Int8Quads = Int8Madd;
#endif

template <class In>
void run_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& bias,
              at::Tensor& y) {
  const int64_t m = x.size(0), np = packed.size(0), steps = packed.size(1);
  const int64_t panel_stride = steps * Int8Quads::kStepElems;
  const vnni::QuantizedRows rows =
      vnni::quantize_rows(x.data_ptr<In>(), m, x.size(1), steps, 4 * steps, Int8Quads::kBiasUnit);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const auto panels = [&](int64_t p, int64_t) { return std::pair{wp + p * panel_stride, panel_stride}; };
  run_tiles<Int8Quads, In>(rows.words.data(), m, steps, steps, np, panels, scales.data_ptr<float>(),
                           bias.defined() ? bias.data_ptr<In>() : nullptr, y.data_ptr<In>(), y.size(1), 1, 0,
                           RowFactors{rows.offset.data(), rows.scale.data()});
}

// nr panels of int8 pairs (panel_stride elements apart) -> bf16 [nr][steps][16][2] at out, value for value
void dequantize(const int8_t* w, int64_t panel_stride, int64_t nr, BFloat16* out) {
  for (int64_t j = 0; j < nr; ++j) {
    const int8_t* src = w + j * panel_stride;
    BFloat16* dst = out + j * panel_stride;
    for (int64_t e = 0; e < panel_stride; e += kPairStep) {
#ifndef ZQ_AVX2
      _mm512_storeu_si512(dst + e, reinterpret_cast<__m512i>(to_bf16_pairs(src + e)));
#else
      store16(dst + e, widen_int8(src + e), 0xFFFF);
      store16(dst + e + kLanes, widen_int8(src + e + kLanes), 0xFFFF);
#endif
    }
  }
}

// Rows up to which every row block converts the panels in registers; above, a buffer. On the SmolLM2-135M layers
// (bench/quant_linear.py, Zen 4, 2026-12-06) converting in registers was 1.17x / 1.04x / 0.99x our bf16 at 16 / 32 /
// 64 rows against the buffer's 0.83x / 0.93x / 0.98x, and 0.90x / 0.94x at 128 / 256 against 0.97x / 0.97x. The AVX2
// build's row block is 2 rows, so converting in each was 0.75x / 0.58x at 8 / 32 rows against the buffer's 0.76x /
// 0.90x: it keeps the buffer above one row block.
#ifndef ZQ_AVX2
constexpr int64_t kDirectRows = 64;
#else
constexpr int64_t kDirectRows = kMaxRows;
#endif

// x [m, ldx] as Kn reads it; y and bias of dtype Y. Up to kDirectRows rows, every row block reads the int8 panels
// through Direct; more convert each group of panels once into a buffer that every row block's Kn then reads.
template <class Kn, class Direct, class Y>
void run(const typename Kn::X* x, int64_t m, int64_t ldx, const at::Tensor& packed, const at::Tensor& scales,
         const at::Tensor& bias, at::Tensor& y) {
  const int64_t np = packed.size(0), steps = packed.size(1), panel_stride = steps * kPairStep;
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const Y* bp = bias.defined() ? bias.data_ptr<Y>() : nullptr;
  if (m <= kDirectRows) {
    const auto panels = [&](int64_t p, int64_t) { return std::pair{wp + p * panel_stride, panel_stride}; };
    return run_tiles<Direct, Y>(x, m, ldx, steps, np, panels, sp, bp, y.data_ptr<Y>(), y.size(1));
  }
  const auto panels = [&](int64_t p, int64_t nr) {
    // each thread's own, kept between calls so a call does not fault in fresh pages: kMaxPanels panels of the
    // widest K seen (K = 1536: 144 KiB)
    thread_local std::vector<BFloat16> buffer;
    if (buffer.size() < static_cast<size_t>(kMaxPanels * panel_stride)) buffer.resize(kMaxPanels * panel_stride);
    dequantize(wp + p * panel_stride, panel_stride, nr, buffer.data());
    return std::pair<const BFloat16*, int64_t>{buffer.data(), panel_stride};
  };
  run_tiles<Kn, Y>(x, m, ldx, steps, np, panels, sp, bp, y.data_ptr<Y>(), y.size(1));
}

template <class Kn, class Direct>
void run_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& bias,
              at::Tensor& y) {
  const int64_t ldx = packed.size(1) * Kn::kXPerStep;
  const auto rows = prepare_rows<Kn>(x.data_ptr<BFloat16>(), x.size(0), x.size(1), ldx);
  run<Kn, Direct, BFloat16>(rows.data(), x.size(0), ldx, packed, scales, bias, y);
}

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t bf16_path) {
  TORCH_CHECK(x.dim() == 2, "linear_int8: x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_int8: x and packed must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_int8: x must be bfloat16 or float32");
  const int64_t m = x.size(0), k = x.size(1), np = packed.size(0);
  // pairs [NP][ceil(K/2)][16][2] (pack_linear), or quads [NP][ceil(K/4)][16][4] for VNNI (quant.pack_int8_vnni)
  const int64_t per_step = packed.dim() == 4 ? packed.size(3) : 0;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  (per_step == 2 || per_step == 4) && packed.size(1) == ceil_div(k, per_step) &&
                  packed.size(2) == kLanes,
              "linear_int8: packed ", packed.sizes(), " is neither pack_linear's int8 pairs nor VNNI quads for K=", k);
  TORCH_CHECK(n > (np - 1) * kLanes && n <= np * kLanes, "linear_int8: n=", n, " does not match ", np, " panels");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "linear_int8: scales must be [", n, "]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "linear_int8: bias must be [", n, "]");
  TORCH_CHECK(bf16_path >= kBf16Widen && bf16_path <= kBf16Amx, "linear_int8: bf16_path must be 0, 1 or 2");
  if (m == 0) return at::empty({0, n}, x.options());
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const at::Tensor bc = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
  if (per_step == 4) {
    const at::Tensor xc = x.contiguous();
    if (x.scalar_type() == at::kFloat) run_vnni<float>(xc, packed, sc, bc, y);
    else run_vnni<BFloat16>(xc, packed, sc, bc, y);
    return y;
  }
  if (x.scalar_type() == at::kFloat) {  // an odd K meets the weights' zero padding
    const at::Tensor xp = k % 2 ? at::constant_pad_nd(x, {0, 1}).contiguous() : x.contiguous();
    run<Bf16Widen, Int8Widen, float>(xp.data_ptr<float>(), m, k + k % 2, packed, sc, bc, y);
    return y;
  }
  const at::Tensor xc = x.contiguous();
#ifndef ZQ_AVX2
  if (bf16_path != kBf16Widen) {
    run_bf16<Bf16Dot, Int8Dot>(xc, packed, sc, bc, y);
    return y;
  }
#endif
  run_bf16<Bf16Widen, Int8Widen>(xc, packed, sc, bc, y);
  return y;
}

}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) { m.impl("linear_int8", &zq::linear_int8); }
