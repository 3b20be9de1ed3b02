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

#include "ops.h"
#include "simd.h"

namespace zq {
namespace {

constexpr int64_t kPrefetchRows = 64;  // how far ahead of the score loop K rows are prefetched

// v[i] <- lower halves of 2S-blocks: x's half-sums, upper halves: y's half-sums (i < S).
template <int S>
inline void fold(vf (&v)[kLanes]) {
  constexpr unsigned upper = S == 8 ? 0xFF00 : S == 4 ? 0xF0F0 : S == 2 ? 0xCCCC : 0xAAAA;
  for (int i = 0; i < S; ++i) {
    const vf x = v[i], y = v[i + S];
    v[i] = vadd(blend<upper>(x, y), swap_halves<S>(blend<upper>(y, x)));
  }
}

// Lane i of the result = the sum of the 16 lanes of v[i]: a transpose-and-add tree in 4 levels.
inline vf sum_lanes16(vf (&v)[kLanes]) {
  fold<8>(v);
  fold<4>(v);
  fold<2>(v);
  fold<1>(v);
  return v[0];
}

// One sequence's kv head and its query heads (a GQA group), attended together so that each K and V row
// is read from memory once for all of them.
template <typename T>
struct Group {
  const T* q;             // [heads][D]
  T* out;                 // [heads][D]
  int64_t heads;
  const T* k;             // [len][ldk]: this sequence's cached keys for this kv head
  const T* v;             // [len][ldv]
  int64_t ldk, ldv, len;
  float scale;
  float* scores;          // scratch [heads][len]
  float* sums;            // scratch [heads]
};

// One query head in registers, as its dot products with cached rows need it: 16 lanes of partial sums.
template <typename T, int NV>
struct Query {  // fp32 (and bf16 in the AVX2 build, widened): FMAs
  vf v[NV];
  explicit Query(const T* q) {
    for (int c = 0; c < NV; c += 2) load32(q + c * kLanes, v + c);
  }
  vf dot(const T* k) const {
    vf acc = vzero();
    for (int c = 0; c < NV; c += 2) {
      vf kv[2];
      load32(k + c * kLanes, kv);
      acc = vfmadd(v[c + 1], kv[1], vfmadd(v[c], kv[0], acc));
    }
    return acc;
  }
};

#ifndef ZQ_AVX2
template <int NV>
struct Query<BFloat16, NV> {  // bf16: VDPBF16PS on the raw pairs, half the instructions of widening
  __m512i v[NV / 2];
  explicit Query(const BFloat16* q) {
    for (int c = 0; c < NV / 2; ++c) v[c] = _mm512_loadu_si512(q + 2 * c * kLanes);
  }
  vf dot(const BFloat16* k) const {
    vf acc = vzero();
    for (int c = 0; c < NV / 2; ++c)
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(v[c]),
                             reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + 2 * c * kLanes)));
    return acc;
  }
};
#endif

// Keeps two streams in flight: K rows kPrefetchRows ahead into L1, and this block's V rows into L2 for
// the V pass after the softmax (measured: -20 to -25% time at 32 sequences x 512 or 2048 positions).
template <typename T, int NV>
void prefetch_block(const Group<T>& g, int64_t t0) {
  constexpr int64_t kRowBytes = NV * kLanes * sizeof(T);
  for (int64_t t = t0; t < std::min(t0 + kLanes, g.len); ++t) {
    const char* v = reinterpret_cast<const char*>(g.v + t * g.ldv);
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(v + b, _MM_HINT_T1);
    if (t + kPrefetchRows >= g.len) continue;
    const char* k = reinterpret_cast<const char*>(g.k + (t + kPrefetchRows) * g.ldk);
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(k + b, _MM_HINT_T0);
  }
}

// scores[h][t] = scale * q[h] . k[t]. Per block of 16 positions, the first head loads the K rows from
// memory and the others from L1; the 16 positions' 16-lane partial dot products are reduced together.
template <typename T, int NV>
void group_scores(const Group<T>& g) {
  for (int64_t t0 = 0; t0 < g.len; t0 += kLanes) {
    const int64_t n = std::min(kLanes, g.len - t0);
    prefetch_block<T, NV>(g, t0);
    for (int64_t h = 0; h < g.heads; ++h) {
      const Query<T, NV> q(g.q + h * NV * kLanes);
      vf part[kLanes];
      for (int i = 0; i < kLanes; ++i) part[i] = i < n ? q.dot(g.k + (t0 + i) * g.ldk) : vzero();
      store16(g.scores + h * g.len + t0, vmul(sum_lanes16(part), vset1(g.scale)), first_n(n));
    }
  }
}

// scores[0:len] <- exp(scores - max); returns their sum.
inline float softmax_numerator(float* scores, int64_t len) {
  vf best = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) best = vmax(best, load16_or(best, first_n(len - t0), scores + t0));
  const vf smax = vset1(reduce_max(best));
  vf vsum = vzero();
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const mask16 m = first_n(len - t0);
    const vf e = keep(m, exp16(vsub(load16(scores + t0, m), smax)));
    store16(scores + t0, e, m);
    vsum = vadd(vsum, e);
  }
  return reduce_add(vsum);
}

// out[h] = sum_t p[h][t] v[t] / sums[h] for heads h0..h0+NH: each V row is loaded and widened once for
// the NH heads, whose accumulators stay in registers.
template <typename T, int NV, int NH>
void group_values(const Group<T>& g, int64_t h0) {
  vf acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NV; ++c) acc[h][c] = vzero();
  for (int64_t t = 0; t < g.len; ++t) {
    vf vv[NV];
    for (int c = 0; c < NV; c += 2) load32(g.v + t * g.ldv + c * kLanes, vv + c);
    for (int h = 0; h < NH; ++h) {
      const vf p = vset1(g.scores[(h0 + h) * g.len + t]);
      for (int c = 0; c < NV; ++c) acc[h][c] = vfmadd(p, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const vf denom = vset1(g.sums[h0 + h]);
    for (int c = 0; c < NV; ++c) acc[h][c] = vdiv(acc[h][c], denom);
    for (int c = 0; c < NV; c += 2) store32(g.out + ((h0 + h) * NV + c) * kLanes, acc[h] + c);
  }
}

// Heads from h0 on, NH at a time, then the rest with fewer.
template <typename T, int NV, int NH>
void values_from(const Group<T>& g, int64_t h0) {
  for (; h0 + NH <= g.heads; h0 += NH) group_values<T, NV, NH>(g, h0);
  if constexpr (NH > 1) {
    if (h0 < g.heads) values_from<T, NV, NH - 1>(g, h0);
  }
}

template <typename T, int NV>
void attend_group(const Group<T>& g) {
  if (g.len == 0) {  // nothing to attend to: zeros
    const vf zero[2] = {vzero(), vzero()};
    for (int64_t c = 0; c < g.heads * NV; c += 2) store32(g.out + c * kLanes, zero);
    return;
  }
  group_scores<T, NV>(g);
  for (int64_t h = 0; h < g.heads; ++h) g.sums[h] = softmax_numerator(g.scores + h * g.len, g.len);
  constexpr int kFused = NV <= 4 ? 4 : 2;  // heads per V pass: NH*NV accumulators + NV widened V in registers
  values_from<T, NV, kFused>(g, 0);
}

struct AttentionArgs {
  int64_t batch, heads, kv_heads, head_dim, max_len;
  const int64_t* slots;
  const int64_t* lengths;
  float scale;
};

// Threads split the (sequence, kv head) pairs: each pair's K and V are streamed once.
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
    std::vector<float> scratch(group * (a.max_len + 1));
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = pair / a.kv_heads, kvh = pair % a.kv_heads, slot = a.slots[b];
      const int64_t first = (b * a.heads + kvh * group) * d;
      const Group<T> g{qp + first, op + first, group,
                       kp + slot * kc.stride(0) + kvh * kc.stride(1), vp + slot * vc.stride(0) + kvh * vc.stride(1),
                       kc.stride(2), vc.stride(2), a.lengths[b], a.scale,
                       scratch.data(), scratch.data() + group * a.max_len};
      attend_group<T, NV>(g);
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

}  // namespace

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

}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) {
  m.impl("decode_attention", &zq::decode_attention);
}
