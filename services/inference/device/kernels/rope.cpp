// zeroqueue::rope_cache: a decoder layer's rotary embedding and KV-cache write in one op. In plain torch the
// same work is ~10 small ops per layer (views, two products, a concatenation, a sum, two index_put_), each
// paying a dispatch of several µs: at batch 1 that is ~2 ms of a ~22 ms step (see BENCHMARKS.md).
// Every product and the sum are rounded to the model dtype as the torch ops round them, so the result is the
// same, bit for bit in bf16; tokens are independent and computed in a fixed order: batch invariant.
// The caches are paged, [N, KVH, BS, D]: token t's k and v go to block slot_mapping[t] / BS, row
// slot_mapping[t] % BS; positions[t] is only its rotary position (the row of cos/sin).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include "ops.h"
#include "simd.h"

namespace zq {
namespace {

constexpr int64_t kParallelElems = 1 << 18;

struct RopeShape {
  int64_t tokens, heads, kv_heads, head_dim, block_size;
};

// x [D] (q or k of one head) rotated at one position: x * cos + cat(x2, x1) * sin, with sin = [-sin, sin]
// as the model's table stores it. Works half by half, so any even head_dim.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const mask16 m = first_n(half - i);
    const vf x1 = load16(x + i, m), x2 = load16(x + half + i, m);
    const vf lo = vadd(round_as<T>(vmul(x1, load16(cos + i, m))), round_as<T>(vmul(x2, load16(sin + i, m))));
    const vf hi = vadd(round_as<T>(vmul(x2, load16(cos + half + i, m))),
                       round_as<T>(vmul(x1, load16(sin + half + i, m))));
    store16(out + i, lo, m);
    store16(out + half + i, hi, m);
  }
}

template <typename T>
void rope_cache_rows(const T* qkv, const T* cos, const T* sin, const int64_t* positions,
                     const int64_t* slot_mapping, T* k_cache, T* v_cache, T* q_out, const RopeShape& s) {
  const int64_t d = s.head_dim, row = (s.heads + 2 * s.kv_heads) * d;
  at::parallel_for(0, s.tokens, std::max<int64_t>(1, kParallelElems / row), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* x = qkv + t * row;
      const int64_t pos = positions[t];
      const T* c = cos + pos * d;
      const T* sn = sin + pos * d;
      for (int64_t h = 0; h < s.heads; ++h) rotate(x + h * d, c, sn, q_out + (t * s.heads + h) * d, d / 2);
      const int64_t block = slot_mapping[t] / s.block_size, offset = slot_mapping[t] % s.block_size;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const int64_t at = ((block * s.kv_heads + h) * s.block_size + offset) * d;  // [block, h, offset, :]
        rotate(x + (s.heads + h) * d, c, sn, k_cache + at, d / 2);
        std::memcpy(v_cache + at, x + (s.heads + s.kv_heads + h) * d, d * sizeof(T));
      }
    }
  });
}

void check_indices(const at::Tensor& index, int64_t tokens, int64_t bound, const char* name) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.size(0) == tokens,
              "rope_cache: ", name, " must be int64 [", tokens, "], got ", index.scalar_type(), " ", index.sizes());
  const int64_t* p = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < bound, "rope_cache: ", name, "[", i, "] = ", p[i], " is outside [0, ", bound, ")");
}

}  // namespace

at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slot_mapping, at::Tensor& k_cache,
                      at::Tensor& v_cache, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2, "rope_cache: qkv must be a 2-d CPU tensor");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat,
              "rope_cache: dtype must be bfloat16 or float32, got ", qkv.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(1) == kv_heads,
              "rope_cache: caches must be contiguous [blocks, ", kv_heads, ", block_size, head_dim], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const RopeShape s{qkv.size(0), heads, kv_heads, k_cache.size(3), k_cache.size(2)};
  TORCH_CHECK(s.head_dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * s.head_dim,
              "rope_cache: qkv must be [tokens, (", heads, " + 2 * ", kv_heads, ") * ", s.head_dim, "], got ",
              qkv.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == s.head_dim && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rope_cache: cos and sin must be contiguous [max_positions, ", s.head_dim, "]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rope_cache: every tensor must be ", qkv.scalar_type());
  check_indices(positions, s.tokens, cos.size(0), "positions");
  check_indices(slot_mapping, s.tokens, k_cache.size(0) * s.block_size, "slot_mapping");
  const at::Tensor x = qkv.contiguous();
  at::Tensor q = at::empty({s.tokens, heads, s.head_dim}, x.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    rope_cache_rows<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), positions.data_ptr<int64_t>(),
                       slot_mapping.data_ptr<int64_t>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                       q.data_ptr<T>(), s);
  };
  x.scalar_type() == at::kBFloat16 ? run(BFloat16()) : run(float());
  return q;
}

}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) { m.impl("rope_cache", &zq::rope_cache); }
