// zeroqueue::decode_attention: one new query token per sequence against its slot of a static KV cache.
// q [B, H, D], k_cache/v_cache [S, KVH, T, D], slots/lengths int64 [B] -> out [B, H, D];
// out[b, h] = softmax(scale * q[b, h] . K[slots[b], h / (H / KVH), :lengths[b]]^T) . V[same], fp32 inside.
// Each (b, h) is computed alone in a fixed order, so it is bit-identical in any batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "simd.h"

namespace zq {
namespace {

// Swap the two halves of every block of 2*S lanes.
template <int S>
inline __m512 swap_halves(__m512 x) {
  if constexpr (S == 8) return _mm512_shuffle_f32x4(x, x, 0x4E);
  if constexpr (S == 4) return _mm512_shuffle_f32x4(x, x, 0xB1);
  if constexpr (S == 2) return _mm512_permute_ps(x, 0x4E);
  if constexpr (S == 1) return _mm512_permute_ps(x, 0xB1);
}

// v[i] <- lower halves of 2S-blocks: x's half-sums, upper halves: y's half-sums (i < S).
template <int S>
inline void fold(__m512 (&v)[kLanes]) {
  constexpr __mmask16 upper = S == 8 ? 0xFF00 : S == 4 ? 0xF0F0 : S == 2 ? 0xCCCC : 0xAAAA;
  for (int i = 0; i < S; ++i) {
    const __m512 x = v[i], y = v[i + S];
    v[i] = _mm512_add_ps(_mm512_mask_blend_ps(upper, x, y), swap_halves<S>(_mm512_mask_blend_ps(upper, y, x)));
  }
}

// Lane i of the result = the sum of the 16 lanes of v[i]: a transpose-and-add tree in 4 levels.
inline __m512 sum_lanes16(__m512 (&v)[kLanes]) {
  fold<8>(v);
  fold<4>(v);
  fold<2>(v);
  fold<1>(v);
  return v[0];
}

// scores[t] = scale * q.k[t] for t < len; k rows are ld elements apart. 16 positions per block, each a
// 16-lane partial dot product, reduced together. NV = head_dim / 16 vectors per row.
template <typename T, int NV>
void head_scores(const __m512 (&q)[NV], const T* k, int64_t ld, int64_t len, float scale, float* scores) {
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min(kLanes, len - t0);
    __m512 part[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      part[i] = _mm512_setzero_ps();
      for (int c = 0; c < NV && i < n; c += 2) {
        __m512 kv[2];
        load32(k + (t0 + i) * ld + c * kLanes, kv);
        part[i] = _mm512_fmadd_ps(q[c + 1], kv[1], _mm512_fmadd_ps(q[c], kv[0], part[i]));
      }
    }
    store16(scores + t0, _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale)), first_n(n));
  }
}

// scores[0:len] <- exp(scores - max); returns their sum.
inline float softmax_numerator(float* scores, int64_t len) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < len; t0 += kLanes)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, first_n(len - t0), scores + t0));
  const __m512 smax = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const __mmask16 m = first_n(len - t0);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t0), smax)));
    _mm512_mask_storeu_ps(scores + t0, m, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// One query head over len cached positions: out = softmax(scores) . V, in fp32 until the final store.
template <typename T, int NV>
void attend_head(const T* q, const T* k, const T* v, int64_t ldk, int64_t ldv, int64_t len, float scale,
                 float* scores, T* out) {
  __m512 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
  if (len > 0) {
    __m512 qv[NV];
    for (int c = 0; c < NV; c += 2) load32(q + c * kLanes, qv + c);
    head_scores<T, NV>(qv, k, ldk, len, scale, scores);
    const __m512 denom = _mm512_set1_ps(softmax_numerator(scores, len));
    for (int64_t t = 0; t < len; ++t) {
      const __m512 p = _mm512_set1_ps(scores[t]);
      for (int c = 0; c < NV; c += 2) {
        __m512 vv[2];
        load32(v + t * ldv + c * kLanes, vv);
        acc[c] = _mm512_fmadd_ps(p, vv[0], acc[c]);
        acc[c + 1] = _mm512_fmadd_ps(p, vv[1], acc[c + 1]);
      }
    }
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_div_ps(acc[c], denom);
  }
  for (int c = 0; c < NV; c += 2) store32(out + c * kLanes, acc + c);  // len 0: zeros
}

struct AttentionArgs {
  int64_t batch, heads, kv_heads, head_dim, max_len;
  const int64_t* slots;
  const int64_t* lengths;
  float scale;
};

// Threads split the (sequence, kv head) pairs; the query heads of one group reread that pair's K/V from
// this core's L2 rather than memory.
template <typename T, int NV>
void attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
                    const AttentionArgs& a) {
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim;
  // Short contexts stay on the calling thread: a fork/join costs more than ~64K cached values take.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, 2 * a.max_len * d));
  at::parallel_for(0, a.batch * a.kv_heads, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores(std::max<int64_t>(a.max_len, 1));
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = pair / a.kv_heads, kvh = pair % a.kv_heads, slot = a.slots[b];
      const T* kb = kp + slot * kc.stride(0) + kvh * kc.stride(1);
      const T* vb = vp + slot * vc.stride(0) + kvh * vc.stride(1);
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        attend_head<T, NV>(qp + (b * a.heads + h) * d, kb, vb, kc.stride(2), vc.stride(2), a.lengths[b], a.scale,
                           scores.data(), op + (b * a.heads + h) * d);
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
                       const AttentionArgs& a) {
  switch (a.head_dim) {
    case 32: return attention_impl<T, 2>(q, kc, vc, out, a);
    case 64: return attention_impl<T, 4>(q, kc, vc, out, a);
    case 128: return attention_impl<T, 8>(q, kc, vc, out, a);
    default: TORCH_CHECK(false, "decode_attention: head_dim must be 32, 64 or 128, got ", a.head_dim);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: k_cache and v_cache must both be [S, KVH, T, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention: tensors must be on the CPU");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == d, "decode_attention: head_dim of q (", d, ") and cache (", k_cache.size(3),
              ") differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: H=", heads, " is not a multiple of KVH=",
              kv_heads);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: cache rows must be contiguous");
  for (const at::Tensor* t : {&slots, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == batch && t->device().is_cpu(),
                "decode_attention: slots and lengths must be int64 [", batch, "] on the CPU");
  const at::Tensor sc = slots.contiguous(), lc = lengths.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k_cache.size(0), "decode_attention: slots[", b, "]=", sp[b],
                " is outside [0, ", k_cache.size(0), ")");
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= k_cache.size(2), "decode_attention: lengths[", b, "]=", lp[b],
                " is outside [0, ", k_cache.size(2), "]");
    max_len = std::max(max_len, lp[b]);
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  const AttentionArgs args{batch, heads, kv_heads, d, max_len, sp, lp, static_cast<float>(scale)};
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<BFloat16>(qc, k_cache, v_cache, out, args);
  } else {
    dispatch_head_dim<float>(qc, k_cache, v_cache, out, args);
  }
  return out;
}

}  // namespace
}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) {
  m.impl("decode_attention", &zq::decode_attention);
}
