// SIMD helpers shared by the kernels: 16 fp32 lanes (vf), bf16/fp32 values <-> vf, and a vector exp.
// One source, two ISAs: the AVX-512 build maps each helper to the one intrinsic the kernels called before;
// the AVX2 build (-DZQ_AVX2) holds 16 lanes in two ymm (lo: lanes 0-7, hi: 8-15) and a mask in 16 bits.
// Keeping 16 lanes keeps pack_linear's 16-column panels, so packed weights are the same in both builds.
// Every function here is deterministic, so kernels built on them stay batch invariant.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace zq {

using c10::BFloat16;
constexpr int64_t kLanes = 16;  // fp32 lanes per vf

#ifndef ZQ_AVX2
constexpr bool kHasBf16Dot = true;  // VDPBF16PS and AMX exist only in the AVX-512 build
using vf = __m512;
using mask16 = __mmask16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
inline vf keep(mask16 m, vf a) { return _mm512_maskz_mov_ps(m, a); }  // lanes outside m zeroed
template <unsigned M>
inline vf blend(vf a, vf b) { return _mm512_mask_blend_ps(M, a, b); }  // lane i: bit i of M ? b : a

// Swap the two halves of every block of 2*S lanes.
template <int S>
inline vf swap_halves(vf x) {
  if constexpr (S == 8) return _mm512_shuffle_f32x4(x, x, 0x4E);
  if constexpr (S == 4) return _mm512_shuffle_f32x4(x, x, 0xB1);
  if constexpr (S == 2) return _mm512_permute_ps(x, 0x4E);
  if constexpr (S == 1) return _mm512_permute_ps(x, 0xB1);
}

// ---- 16 values <-> one vf ----
inline vf widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline vf load16(const float* p) { return _mm512_loadu_ps(p); }
inline vf load16(const BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf load16(const float* p, mask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline vf load16(const BFloat16* p, mask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline vf load16_or(vf src, mask16 m, const float* p) { return _mm512_mask_loadu_ps(src, m, p); }  // src outside m
inline void store16(float* p, vf v, mask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(BFloat16* p, vf v, mask16 m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));  // round to nearest even
}

// 16 bf16 pairs (64 bytes) -> the first (u = 0) or second (u = 1) element of each pair, exact.
inline vf pair_half(const BFloat16* p, int u) {
  const __m512i w = _mm512_loadu_si512(p);
  return _mm512_castsi512_ps(u == 0 ? _mm512_slli_epi32(w, 16)
                                    : _mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
#else
constexpr bool kHasBf16Dot = false;
struct vf {
  __m256 lo, hi;
};
using mask16 = uint16_t;

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

// 8 lanes -> 1, a fixed tree: 8 -> 4 -> 2 -> 1.
template <class Op>
inline float reduce8(__m256 a, Op op) {
  __m128 x = op(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_shuffle_ps(x, x, 0x55)));
}
inline float reduce_add(vf a) {
  return reduce8(_mm256_add_ps(a.lo, a.hi), [](__m128 x, __m128 y) { return _mm_add_ps(x, y); });
}
inline float reduce_max(vf a) {
  return reduce8(_mm256_max_ps(a.lo, a.hi), [](__m128 x, __m128 y) { return _mm_max_ps(x, y); });
}

// bits 0-7 (lo) or 8-15 (hi) of a mask -> 8 lanes of all-ones or zeros
inline __m256i lanes(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits & 0xFF)), sel), sel);
}
inline vf keep(mask16 m, vf a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes(m))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes(m >> 8)))};
}
template <unsigned M>
inline vf blend(vf a, vf b) { return {_mm256_blend_ps(a.lo, b.lo, M & 0xFF), _mm256_blend_ps(a.hi, b.hi, M >> 8)}; }

template <int S>
inline vf swap_halves(vf x) {
  if constexpr (S == 8) return {x.hi, x.lo};
  if constexpr (S == 4) return {_mm256_permute2f128_ps(x.lo, x.lo, 0x01), _mm256_permute2f128_ps(x.hi, x.hi, 0x01)};
  if constexpr (S == 2) return {_mm256_permute_ps(x.lo, 0x4E), _mm256_permute_ps(x.hi, 0x4E)};
  if constexpr (S == 1) return {_mm256_permute_ps(x.lo, 0xB1), _mm256_permute_ps(x.hi, 0xB1)};
}

// fp32 -> bf16 in the upper 16 bits of each lane, lower bits zero: round to nearest even, NaN kept and
// made quiet, as VCVTNEPS2BF16 and torch round (without the former's flush of denormals).
inline __m256i round_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan), _mm256_set1_epi32(int32_t(0xFFFF0000u)));
}
// 16 lanes -> 16 bf16 in lane order
inline __m256i to_bf16(vf v) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(round_bits(v.lo), 16),
                                             _mm256_srli_epi32(round_bits(v.hi), 16));
  return _mm256_permute4x64_epi64(packed, 0xD8);  // packus interleaves the 128-bit halves
}

// ---- 16 values <-> one vf ----
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf widen_bf16(__m256i h) { return {widen8(_mm256_castsi256_si128(h)), widen8(_mm256_extracti128_si256(h, 1))}; }
inline vf load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load16(const BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// Whole vectors take plain loads and stores: VMASKMOVPS is slower, much so as a store on AMD cores.
inline vf load16(const float* p, mask16 m) {
  if (m == 0xFFFF) return load16(p);
  return {_mm256_maskload_ps(p, lanes(m)), _mm256_maskload_ps(p + 8, lanes(m >> 8))};
}
inline vf load16(const BFloat16* p, mask16 m) {
  if (m == 0xFFFF) return load16(p);
  alignas(32) uint16_t buf[kLanes] = {};  // no 16-bit masked load in AVX2: only the lanes of m are read
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1) buf[i] = reinterpret_cast<const uint16_t*>(p)[i];
  return widen_bf16(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
}
inline vf load16_or(vf src, mask16 m, const float* p) {
  const vf v = load16(p, m);
  const __m256 lo = _mm256_castsi256_ps(lanes(m)), hi = _mm256_castsi256_ps(lanes(m >> 8));
  return {_mm256_blendv_ps(src.lo, v.lo, lo), _mm256_blendv_ps(src.hi, v.hi, hi)};
}
inline void store16(float* p, vf v, mask16 m) {
  if (m == 0xFFFF) {
    _mm256_storeu_ps(p, v.lo);
    return _mm256_storeu_ps(p + 8, v.hi);
  }
  _mm256_maskstore_ps(p, lanes(m), v.lo);
  _mm256_maskstore_ps(p + 8, lanes(m >> 8), v.hi);
}
inline void store16(BFloat16* p, vf v, mask16 m) {
  const __m256i h = to_bf16(v);
  if (m == 0xFFFF) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  alignas(32) uint16_t buf[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1) reinterpret_cast<uint16_t*>(p)[i] = buf[i];
}

inline __m256 half_of_pairs(const BFloat16* p, int u) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(u == 0 ? _mm256_slli_epi32(w, 16)
                                    : _mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline vf pair_half(const BFloat16* p, int u) { return {half_of_pairs(p, u), half_of_pairs(p + 16, u)}; }
#endif

inline mask16 first_n(int64_t n) { return n >= kLanes ? mask16(0xFFFF) : mask16((1u << n) - 1u); }

// 32 consecutive values <-> two vf, in a lane order that only has to agree between operands:
// fp32: elements 0-15 and 16-31; bf16: even and odd elements (one load, then a shift and a mask, which
// is cheaper than two widening loads).
inline void load32(const float* p, vf* v) { v[0] = load16(p); v[1] = load16(p + kLanes); }
inline void load32(const BFloat16* p, vf* v) {
#ifndef ZQ_AVX2
  const __m512i w = _mm512_loadu_si512(p);
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  v[1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
#else
  v[0] = pair_half(p, 0);
  v[1] = pair_half(p, 1);
#endif
}
inline void store32(float* p, const vf* v) {
#ifndef ZQ_AVX2
  _mm512_storeu_ps(p, v[0]);
  _mm512_storeu_ps(p + kLanes, v[1]);
#else
  store16(p, v[0], 0xFFFF);
  store16(p + kLanes, v[1], 0xFFFF);
#endif
}
inline void store32(BFloat16* p, const vf* v) {
#ifndef ZQ_AVX2
  const __m512i even = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v[0])));
  const __m512i odd = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v[1])));
  _mm512_storeu_si512(p, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
#else
  // lane j of v[0] / v[1] is element 2j / 2j+1: the rounded bits are already in place as pairs
  const auto pairs = [](__m256 even, __m256 odd) {
    return _mm256_or_si256(_mm256_srli_epi32(round_bits(even), 16), round_bits(odd));
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pairs(v[0].lo, v[1].lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), pairs(v[0].hi, v[1].hi));
#endif
}

// v rounded to T's precision and back (what storing as T then loading would give).
template <typename T>
inline vf round_as(vf v) {
  if constexpr (std::is_same_v<T, float>) return v;
#ifndef ZQ_AVX2
  else return widen_bf16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  else return {_mm256_castsi256_ps(round_bits(v.lo)), _mm256_castsi256_ps(round_bits(v.hi))};
#endif
}

// exp(x) for softmax and silu: x = n*ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness),
// exp(r) by its Taylor series to r^6 (~1 ulp), then scaled by 2^n. NaN stays NaN.
#ifndef ZQ_AVX2
inline vf exp16(vf x) {
  x = _mm512_max_ps(_mm512_set1_ps(-88.0f), x);  // exp(-88) is already below FLT_MIN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#else
// 2^n for integral n in [-127, 128], as two factors 2^(n/2) 2^(n - n/2) so that neither leaves the normal
// range (scalef's result, denormals included).
inline __m256 scale8(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
inline __m256 exp8(__m256 x) {
  // NaN passes min and max (they return their second operand); exp(89) is already above FLT_MAX
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-88.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  return scale8(p, n);
}
inline vf exp16(vf x) { return {exp8(x.lo), exp8(x.hi)}; }
#endif

}  // namespace zq
