// zeroqueue::decode_attention: one new query token per sequence against its blocks of a paged KV cache.
// q [B, H, D], k_cache/v_cache [N, KVH, BS, D], block_tables int64 [B, M], lengths int64 [B] -> out [B, H, D];
// position p of sequence b lives in block block_tables[b, p / BS] at row p % BS, and
// out[b, h] = softmax(scale * q[b, h] . K_b[h / (H / KVH), :lengths[b]]^T) . V_b[same], fp32 inside.
// Each (b, h) is computed alone in a fixed order over its positions, so it is bit-identical in any batch,
// whatever the block size and whichever blocks hold its rows.
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

constexpr int64_t kPrefetchRows = 64;     // how far ahead of the score loop K rows are prefetched into L1
constexpr int64_t kPrefetchL2Rows = 128;  // how far ahead K and V rows are prefetched into L2 (L2Stream)

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

// A sequence's positions walked 16 at a time through its block table. The block size is a multiple of 16
// (checked in decode_attention), so no run of 16 straddles two blocks: one table lookup and one base pointer a
// run, no division, and the inner loops over the run's rows stay those of a contiguous cache.
class Cursor {
 public:
  Cursor(const int64_t* table, int64_t block_size, int64_t t)
      : table_(table), block_size_(block_size), block_(t / block_size), row_(t % block_size) {}
  // The first of this run's rows in a cache whose block 0 starts at base: [16 rows][ld].
  template <typename T>
  const T* rows(const T* base, int64_t block_stride, int64_t ld) const {
    return base + table_[block_] * block_stride + row_ * ld;
  }
  void next() {
    row_ += kLanes;
    if (row_ == block_size_) {
      row_ = 0;
      ++block_;
    }
  }

 private:
  const int64_t* table_;
  int64_t block_size_, block_, row_;
};

struct AttentionArgs {
  int64_t batch, heads, kv_heads, head_dim, max_len, block_size;
  const int64_t* tables;  // [batch][table_width]
  int64_t table_width;
  const int64_t* lengths;
  float scale;
};

// K and V rows into L2 kPrefetchL2Rows ahead of the score loop, in the order a thread reads them: through each
// (sequence, kv head) pair's block table, and on past a pair's last row into the thread's next pairs. On a
// contiguous cache the hardware's L2 streamer did this (a thread's pairs were one stream in each cache); a paged
// cache is pieces of BS rows (2 KB at BS 16, D 64, bf16) anywhere, too short for it. Measured at 1-32 sequences x
// 512-2048 positions, bf16, BS 16 and 32, the cache read from memory as a step's other layers leave it: without
// this 20-35% more time than the contiguous cache, with it within +-10% of it. Where the cache is still in L2/L3
// from the call before (a benchmark's loop), the scattered rows cost 15-35% with or without it.
template <typename T>
class L2Stream {
 public:
  // The thread's pairs [pair, end) of the caches kc, vc (whose data begin at k, v), with a's tables and lengths.
  L2Stream(const T* k, const T* v, const at::Tensor& kc, const at::Tensor& vc, const AttentionArgs& a, int64_t pair,
           int64_t end)
      : k_(k), v_(v), kblock_(kc.stride(0)), khead_(kc.stride(1)), ldk_(kc.stride(2)), vblock_(vc.stride(0)),
        vhead_(vc.stride(1)), ldv_(vc.stride(2)), a_(a), pair_(pair), end_(end), at_(table(pair), a.block_size, 0) {}

  // The score loop is about to read n more rows: keep kPrefetchL2Rows prefetched past them.
  void advance(int64_t n) {
    ahead_ -= n;
    while (ahead_ < kPrefetchL2Rows && pair_ < end_) {
      const int64_t len = a_.lengths[pair_ / a_.kv_heads], kvh = pair_ % a_.kv_heads;
      if (row_ >= len) {  // on to the next pair (the table is read only below each pair's length)
        if (++pair_ < end_) at_ = Cursor(table(pair_), a_.block_size, 0);
        row_ = 0;
        continue;
      }
      const int64_t rows = std::min(kLanes, len - row_);
      prefetch(at_.rows(k_ + kvh * khead_, kblock_, ldk_), rows, ldk_);
      prefetch(at_.rows(v_ + kvh * vhead_, vblock_, ldv_), rows, ldv_);
      row_ += kLanes;
      at_.next();
      ahead_ += rows;
    }
  }

 private:
  const int64_t* table(int64_t pair) const { return a_.tables + pair / a_.kv_heads * a_.table_width; }
  void prefetch(const T* first, int64_t rows, int64_t ld) const {
    for (int64_t i = 0; i < rows; ++i) {
      const char* row = reinterpret_cast<const char*>(first + i * ld);
      for (int64_t b = 0; b < a_.head_dim * int64_t(sizeof(T)); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
  }

  const T* k_;
  const T* v_;
  int64_t kblock_, khead_, ldk_, vblock_, vhead_, ldv_;  // strides of the caches [N, KVH, BS, D]
  const AttentionArgs& a_;
  int64_t pair_, end_;  // the pair whose rows are prefetched next, and the end of the thread's pairs
  Cursor at_;           // the next run of rows to prefetch: row_ of pair_
  int64_t row_ = 0, ahead_ = 0;
};

// One sequence's kv head and its query heads (a GQA group), attended together so that each K and V row
// is read from memory once for all of them.
template <typename T>
struct Group {
  const T* q;             // [heads][D]
  T* out;                 // [heads][D]
  int64_t heads;
  const T* k;             // this kv head in block 0: block j's row r is at k + j * kblock + r * ldk
  const T* v;             // the same with vblock, ldv
  int64_t kblock, vblock, ldk, ldv;
  const int64_t* table;   // [>= ceil(len / block_size)]: this sequence's block ids
  int64_t block_size, len;
  float scale;
  float* scores;          // scratch [heads][len]
  float* sums;            // scratch [heads]
  L2Stream<T>* stream;    // this thread's prefetches into L2
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

// K rows kPrefetchRows ahead into L1 (from L2, where the L2Stream has put them): n rows from k_ahead, found
// through the block table.
template <typename T, int NV>
void prefetch_k(const Group<T>& g, const T* k_ahead, int64_t n) {
  constexpr int64_t kRowBytes = NV * kLanes * sizeof(T);
  for (int64_t i = 0; i < n; ++i) {
    const char* kr = reinterpret_cast<const char*>(k_ahead + i * g.ldk);
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(kr + b, _MM_HINT_T0);
  }
}

// scores[h][t] = scale * q[h] . k[t]. Per run of 16 positions (in one block), the first head loads the K rows
// from memory and the others from L1; the 16 positions' 16-lane partial dot products are reduced together.
template <typename T, int NV>
void group_scores(const Group<T>& g) {
  static_assert(kPrefetchRows % kLanes == 0, "the prefetch runs must stay within one block, as the runs do");
  Cursor at(g.table, g.block_size, 0), ahead(g.table, g.block_size, kPrefetchRows);
  for (int64_t t0 = 0; t0 < g.len; t0 += kLanes, at.next(), ahead.next()) {
    const int64_t n = std::min(kLanes, g.len - t0), n_ahead = std::min(kLanes, g.len - t0 - kPrefetchRows);
    g.stream->advance(n);
    // the table is read only for positions below len: its entries past those may be any id
    if (n_ahead > 0) prefetch_k<T, NV>(g, ahead.rows(g.k, g.kblock, g.ldk), n_ahead);
    const T* k = at.rows(g.k, g.kblock, g.ldk);
    for (int64_t h = 0; h < g.heads; ++h) {
      const Query<T, NV> q(g.q + h * NV * kLanes);
      vf part[kLanes];
      for (int i = 0; i < kLanes; ++i) part[i] = i < n ? q.dot(k + i * g.ldk) : vzero();
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
  Cursor at(g.table, g.block_size, 0);
  for (int64_t t0 = 0; t0 < g.len; t0 += kLanes, at.next()) {  // positions in order: the same sums as one block
    const T* v = at.rows(g.v, g.vblock, g.ldv);
    for (int64_t i = 0, n = std::min(kLanes, g.len - t0); i < n; ++i) {
      vf vv[NV];
      for (int c = 0; c < NV; c += 2) load32(v + i * g.ldv + c * kLanes, vv + c);
      for (int h = 0; h < NH; ++h) {
        const vf p = vset1(g.scores[(h0 + h) * g.len + t0 + i]);
        for (int c = 0; c < NV; ++c) acc[h][c] = vfmadd(p, vv[c], acc[h][c]);
      }
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
    L2Stream<T> stream(kp, vp, kc, vc, a, p0, p1);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = pair / a.kv_heads, kvh = pair % a.kv_heads;
      const int64_t first = (b * a.heads + kvh * group) * d;
      const Group<T> g{qp + first, op + first, group, kp + kvh * kc.stride(1), vp + kvh * vc.stride(1),
                       kc.stride(0), vc.stride(0), kc.stride(2), vc.stride(2), a.tables + b * a.table_width,
                       a.block_size, a.lengths[b], a.scale, scratch.data(), scratch.data() + group * a.max_len,
                       &stream};
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
                            const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: k_cache and v_cache must both be [N, KVH, BS, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention: tensors must be on the CPU");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(1);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "decode_attention: head_dim of q (", d, ") and cache (", k_cache.size(3),
              ") differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: H=", heads, " is not a multiple of KVH=",
              kv_heads);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: cache rows must be contiguous");
  // Whole runs of 16 rows in a block let the loops take one base pointer a run (see Cursor); other sizes would
  // cost a lookup a row in the hottest loop.
  TORCH_CHECK(block_size > 0 && block_size % kLanes == 0,
              "decode_attention: the block size (BS) must be a positive multiple of ", kLanes, ", got ", block_size);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  block_tables.device().is_cpu(),
              "decode_attention: block_tables must be int64 [", batch, ", M] on the CPU, got ",
              block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == batch &&
                  lengths.device().is_cpu(),
              "decode_attention: lengths must be int64 [", batch, "] on the CPU");
  const at::Tensor tc = block_tables.contiguous(), lc = lengths.contiguous();
  const int64_t width = tc.size(1), capacity = width * block_size;
  const int64_t* tp = tc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= capacity, "decode_attention: lengths[", b, "]=", lp[b], " is outside [0, ",
                capacity, "]");
    for (int64_t j = 0; j * block_size < lp[b]; ++j) {  // only the blocks this row reads
      const int64_t id = tp[b * width + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "decode_attention: block_tables[", b, ", ", j, "]=", id,
                  " is outside [0, ", num_blocks, ")");
    }
    max_len = std::max(max_len, lp[b]);
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  const AttentionArgs args{batch, heads, kv_heads, d, max_len, block_size, tp, width, lp, static_cast<float>(scale)};
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
