// What the VNNI paths of linear_int8.cpp and linear_int4.cpp share (AVX-512 builds only): x quantized per row to
// int8 at the call, and VPDPBUSD.
//
// A row's int8 values are q = round(x * 127 / amax), to nearest even in fp32, and its factor amax / 127 (0 for a row
// of zeros). The weights are stored as unsigned bytes, w + bias_unit (128 for int8, 8 for int4 nibbles), VPDPBUSD's
// unsigned operand; so a sum over a group of inputs starts at -bias_unit * (that group's sum of q) to take the bias
// back out, exactly. quant.quantize_rows_int8 is the same in plain torch.
#pragma once

#ifndef ZQ_AVX2
#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace zq {
namespace vnni {

// acc += VPDPBUSD(w unsigned, x signed). Written in asm: GCC 12's _mm512_dpbusd_epi32 keeps its accumulator in
// zmm0-15, so a tile of 24 spilled to the stack every step (1.5x slower at 32 rows).
inline void dpbusd(__m512i& acc, __m512i w, __m512i x) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

// The same with x's 4 bytes broadcast from memory (no register held for them)
inline void dpbusd(__m512i& acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

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
    for (int64_t c = 0; c < k; c += kLanes) top = _mm512_max_ps(top, _mm512_abs_ps(load16(row + c, first_n(k - c))));
    const float amax = reduce_max(top);
    const vf inv = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
    int8_t* q = reinterpret_cast<int8_t*>(out.words.data() + r * ldx);
    for (int64_t g = 0; g < groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = g * group_inputs; c < std::min(k, (g + 1) * group_inputs); c += kLanes) {
        const mask16 mask = first_n(k - c);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + c, mask), inv));  // to nearest, even
        sum = _mm512_add_epi32(sum, v);
        _mm512_mask_cvtsepi32_storeu_epi8(q + c, mask, v);
      }
      out.offset[r * groups + g] = -bias_unit * _mm512_reduce_add_epi32(sum);
    }
    out.scale[r] = amax / 127.0f;
  }
  return out;
}

}  // namespace vnni
}  // namespace zq
#endif
