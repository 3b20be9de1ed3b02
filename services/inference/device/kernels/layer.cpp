// zeroqueue::decode_layers: every decoder layer of a step in one op. Each row attends from its own position
// over its sequence's blocks of the paged cache (its row of block_tables), which rope_cache has just written at
// slot_mapping for all of the step's rows: decode rows see their context, a prompt chunk's rows are causal. A
// decode-only step runs the layer-by-layer path's kernels in its order (packed.py), so it is bit-identical to it;
// what goes is the per-op cost of Python and the dispatcher (~30 calls a layer), which at batch 1 was a third of
// the step.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace zq {
namespace {

// weights per layer: input norm, qkv, o, post-attention norm, gate_up, down (linears packed by pack_linear)
constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kBiasesPerLayer = 4;  // qkv, o, gate_up, down: each optional
constexpr int64_t kScalesPerLayer = 4;  // qkv, o, gate_up, down: scales of int8 / int4 weights, else none

// one linear: int8 and int4 (uint8 nibbles) weights take their scales (linear_int8.cpp, linear_int4.cpp), bf16 /
// fp32 ones none (linear.cpp)
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales,
                 const std::optional<at::Tensor>& bias, int64_t n, int64_t bf16_path) {
  const bool int8 = w.scalar_type() == at::kChar, int4 = w.scalar_type() == at::kByte;
  if (!int8 && !int4) return linear(x, w, bias, n, bf16_path);
  TORCH_CHECK(scales.has_value(), "decode_layers: a quantized weight needs its scales");
  return int8 ? linear_int8(x, w, *scales, bias, n, bf16_path) : linear_int4(x, w, *scales, bias, n, bf16_path);
}

struct LayerArgs {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& positions;     // [T] rotary positions
  const at::Tensor& slot_mapping;  // [T] where each row's k and v go: block * BS + offset
  const at::Tensor& block_tables;  // [T, M]
  const at::Tensor& lengths;       // [T]
  at::IntArrayRef out_features;  // qkv, o, gate_up, down
  int64_t heads, kv_heads;
  double eps, scale;
  int64_t bf16_path;
};

// (x, residual) -> (this layer's MLP output, the residual stream before it), as DecoderLayer.forward.
std::tuple<at::Tensor, at::Tensor> layer_forward(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor* w, const std::optional<at::Tensor>* b,
                                                 const std::optional<at::Tensor>* s, at::Tensor k_cache,
                                                 at::Tensor v_cache, const LayerArgs& a) {
  at::Tensor h, stream;
  if (residual.defined()) {
    std::tie(h, stream) = add_rms_norm(x, residual, w[0], a.eps);
  } else {
    h = rms_norm(x, w[0], a.eps);
    stream = x;
  }
  const at::Tensor qkv = dense(h, w[1], s[0], b[0], a.out_features[0], a.bf16_path);
  const at::Tensor q =
      rope_cache(qkv, a.cos, a.sin, a.positions, a.slot_mapping, k_cache, v_cache, a.heads, a.kv_heads);
  const at::Tensor att = decode_attention(q, k_cache, v_cache, a.block_tables, a.lengths, a.scale);  // [B, H, D]
  const at::Tensor o = dense(att.reshape({att.size(0), -1}), w[2], s[1], b[1], a.out_features[1], a.bf16_path);
  std::tie(h, stream) = add_rms_norm(o, stream, w[3], a.eps);
  const at::Tensor act = silu_mul(dense(h, w[4], s[2], b[2], a.out_features[2], a.bf16_path));
  return {dense(act, w[5], s[3], b[3], a.out_features[3], a.bf16_path), stream};
}

std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& x, at::TensorList weights,
                                                 const c10::List<std::optional<at::Tensor>>& biases,
                                                 const c10::List<std::optional<at::Tensor>>& scales,
                                                 at::IntArrayRef out_features, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& positions,
                                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                 const at::Tensor& lengths, at::Tensor& k_cache,
                                                 at::Tensor& v_cache, int64_t heads, int64_t kv_heads, double eps,
                                                 double scale, int64_t bf16_path) {
  TORCH_CHECK(x.dim() == 2, "decode_layers: x must be [B, hidden], got ", x.sizes());
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes(),
              "decode_layers: caches must both be [layers, blocks, KVH, block_size, D], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  const int64_t layers = k_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers,
              "decode_layers: expected ", kWeightsPerLayer, " weights for each of ", layers, " layers, got ",
              weights.size());
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers, "decode_layers: expected ",
              kBiasesPerLayer, " biases (or None) for each of ", layers, " layers, got ", biases.size());
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == kScalesPerLayer * layers, "decode_layers: expected ",
              kScalesPerLayer, " scales (or None) for each of ", layers, " layers, got ", scales.size());
  TORCH_CHECK(out_features.size() == 4, "decode_layers: out_features must be [qkv, o, gate_up, down]");
  const LayerArgs args{cos, sin, positions, slot_mapping, block_tables, lengths, out_features,
                       heads, kv_heads, eps, scale, bf16_path};
  std::vector<std::optional<at::Tensor>> b(biases.begin(), biases.end()), s(scales.begin(), scales.end());
  at::Tensor h = x, residual;
  for (int64_t i = 0; i < layers; ++i) {
    std::tie(h, residual) = layer_forward(h, residual, weights.data() + i * kWeightsPerLayer,
                                          b.data() + i * kBiasesPerLayer, s.data() + i * kScalesPerLayer,
                                          k_cache.select(0, i),
                                          v_cache.select(0, i), args);
  }
  return {h, residual};
}

}  // namespace
}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) { m.impl("decode_layers", &zq::decode_layers); }
