// AVX-512 helpers shared by the kernels: bf16/fp32 values <-> zmm registers of fp32, and a vector exp.
// Every function here is deterministic, so kernels built on them stay batch invariant.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace zq {

using c10::BFloat16;
constexpr int64_t kLanes = 16;  // fp32 lanes per zmm

// ---- 16 values <-> one zmm of fp32 ----
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const BFloat16* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));  // round to nearest even
}
inline __mmask16 first_n(int64_t n) { return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// 32 consecutive values <-> two zmm of fp32, in a lane order that only has to agree between operands:
// fp32: elements 0-15 and 16-31; bf16: even and odd elements (one load, then a shift and a mask, which
// is cheaper than two widening loads).
inline void load32(const float* p, __m512* v) { v[0] = _mm512_loadu_ps(p); v[1] = _mm512_loadu_ps(p + kLanes); }
inline void load32(const BFloat16* p, __m512* v) {
  const __m512i w = _mm512_loadu_si512(p);
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  v[1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void store32(float* p, const __m512* v) { _mm512_storeu_ps(p, v[0]); _mm512_storeu_ps(p + kLanes, v[1]); }
inline void store32(BFloat16* p, const __m512* v) {
  const __m512i even = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v[0])));
  const __m512i odd = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v[1])));
  _mm512_storeu_si512(p, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
}

// v rounded to T's precision and back (what storing as T then loading would give).
template <typename T>
inline __m512 round_as(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return widen_bf16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// exp(x) for softmax and silu: x = n*ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness),
// exp(r) by its Taylor series to r^6 (~1 ulp), then scaled by 2^n. NaN stays NaN.
inline __m512 exp16(__m512 x) {
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

}  // namespace zq
