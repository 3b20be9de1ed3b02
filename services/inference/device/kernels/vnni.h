// What the integer paths of linear_int8.cpp and linear_int4.cpp share (the `vnni` int path, both builds): x quantized
// per row to int8 at the call, and the instructions that multiply int8 by unsigned bytes and sum in int32.
//
// A row's int8 values are q = round(x * 127 / amax), to nearest even in fp32, and its factor amax / 127 (0 for a row
// of zeros). The weights are stored as unsigned bytes, w + bias_unit (128 for int8, 8 for int4 nibbles), the unsigned
// operand; so a sum over a group of inputs starts at -bias_unit * (that group's sum of q) to take the bias back out,
// exactly. quant.quantize_rows_int8 is the same in plain torch.
//
// AVX-512: VPDPBUSD multiplies 64 byte pairs and sums them in fours into 16 int32 lanes. AVX2 has no such instruction:
// VPMADDUBSW multiplies 32 byte pairs and sums them in twos into int16 lanes (saturating), VPMADDWD with ones sums
// those pairs into 8 int32 lanes. The int16 sums stay exact as long as a pair of products fits: nibbles (<= 15) by
// |q| <= 127 always do; int8 weights do once the sign of x moves onto them (linear_int8.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace zq {
namespace vnni {

#ifndef ZQ_AVX2
// acc += VPDPBUSD(w unsigned, x signed). Written in asm: GCC 12's _mm512_dpbusd_epi32 keeps its accumulator in
// zmm0-15, so a tile of 24 spilled to the stack every step (1.5x slower at 32 rows).
inline void dpbusd(__m512i& acc, __m512i w, __m512i x) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

// The same with x's 4 bytes broadcast from memory (no register held for them)
inline void dpbusd(__m512i& acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

using vi = __m512i;  // 16 int32 lanes
inline vi vi_zero() { return _mm512_setzero_si512(); }
inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline int32_t vi_sum(vi a) { return _mm512_reduce_add_epi32(a); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }

// 16 lanes of fp32 -> int32 to nearest even; the lanes of m stored at q as int8 (saturated; |v| <= 127 here)
inline vi to_int8(vf v, mask16 m, int8_t* q) {
  const __m512i i = _mm512_cvtps_epi32(v);
  _mm512_mask_cvtsepi32_storeu_epi8(q, m, i);
  return i;
}
#else
struct vi {
  __m256i lo, hi;
};
inline vi vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi vi_add(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline int32_t vi_sum(vi a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
inline vf vabs(vf a) {
  const __m256 bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, bits), _mm256_and_ps(a.hi, bits)};
}

inline vi to_int8(vf v, mask16 m, int8_t* q) {
  const __m256i a = _mm256_cvtps_epi32(v.lo), b = _mm256_cvtps_epi32(v.hi);
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // packs interleaves the halves
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  if (m == 0xFFFF) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), bytes);
  } else {
    alignas(16) int8_t all[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(all), bytes);
    std::memcpy(q, all, __builtin_popcount(m));  // m is always the first n lanes
  }
  return {a, b};
}
#endif

// x [M, K] quantized per row: words [M][ldx] (4 int8 a word, zeros past K), offset [M][groups] (each group's
// -bias_unit * sum of q), scale [M]
struct QuantizedRows {
  std::vector<int32_t> words;
  std::vector<int32_t> offset;
  std::vector<float> scale;
  int64_t groups;
};

// group_inputs: a multiple of 16 (a vector of x), or >= K for one group a row
template <class In>
QuantizedRows quantize_rows(const In* x, int64_t m, int64_t k, int64_t ldx, int64_t group_inputs, int32_t bias_unit) {
  const int64_t groups = (k + group_inputs - 1) / group_inputs;
  QuantizedRows out{std::vector<int32_t>(m * ldx, 0), std::vector<int32_t>(m * groups), std::vector<float>(m), groups};
  for (int64_t r = 0; r < m; ++r) {
    const In* row = x + r * k;
    vf top = vzero();
    for (int64_t c = 0; c < k; c += kLanes) top = vmax(top, vabs(load16(row + c, first_n(k - c))));
    const float amax = reduce_max(top);
    const vf inv = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
    int8_t* q = reinterpret_cast<int8_t*>(out.words.data() + r * ldx);
    for (int64_t g = 0; g < groups; ++g) {
      vi sum = vi_zero();
      for (int64_t c = g * group_inputs; c < std::min(k, (g + 1) * group_inputs); c += kLanes) {
        const mask16 mask = first_n(k - c);
        sum = vi_add(sum, to_int8(vmul(load16(row + c, mask), inv), mask, q + c));  // lanes past K are 0
      }
      out.offset[r * groups + g] = -bias_unit * vi_sum(sum);
    }
    out.scale[r] = amax / 127.0f;
  }
  return out;
}

}  // namespace vnni
}  // namespace zq
