// zeroqueue::rms_norm, add_rms_norm and silu_mul: the small ops of a decoder layer, fused so that a decode
// step at batch 1 pays one dispatch for each instead of 2-5 (see BENCHMARKS.md, "CPU kernels").
// Rows are independent and computed in a fixed order: batch invariant.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace zq {
namespace {

// Below this many elements a second thread costs more (fork/join, or a whole time slice when the other
// core is busy) than it saves; decode batches stay on the calling thread, prefill chunks spread out.
constexpr int64_t kParallelElems = 1 << 18;

// Rows of x [rows, cols]: weight * to_T(x * rsqrt(mean(x^2) + eps)), the mean in fp32 (Hugging Face RMSNorm).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      vf squares = vzero();
      for (int64_t c = 0; c < cols; c += kLanes) {
        const vf v = load16(xr + c, first_n(cols - c));
        squares = vfmadd(v, v, squares);
      }
      const vf inv = vset1(1.0f / std::sqrt(reduce_add(squares) / cols + eps));
      for (int64_t c = 0; c < cols; c += kLanes) {
        const mask16 m = first_n(cols - c);
        const vf normed = round_as<T>(vmul(load16(xr + c, m), inv));
        store16(out + r * cols + c, vmul(load16(w + c, m), normed), m);
      }
    }
  });
}

// The residual stream and the next norm in one pass: sum = to_T(x + residual) [rows, cols], and
// out = rms_norm(sum) as rms_norm_rows computes it.
template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* w, T* sum, T* out, int64_t rows, int64_t cols,
                       float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * cols;
      vf squares = vzero();
      for (int64_t c = 0; c < cols; c += kLanes) {
        const mask16 m = first_n(cols - c);
        const vf v = round_as<T>(vadd(load16(x + base + c, m), load16(residual + base + c, m)));
        store16(sum + base + c, v, m);
        squares = vfmadd(v, v, squares);
      }
      const vf inv = vset1(1.0f / std::sqrt(reduce_add(squares) / cols + eps));
      for (int64_t c = 0; c < cols; c += kLanes) {
        const mask16 m = first_n(cols - c);
        const vf normed = round_as<T>(vmul(load16(sum + base + c, m), inv));
        store16(out + base + c, vmul(load16(w + c, m), normed), m);
      }
    }
  });
}

// gate_up [rows, 2I] -> to_T(silu(gate)) * up [rows, I], as F.silu(gate) * up rounds in T.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = gate_up + r * 2 * inter;
      const T* up = gate + inter;
      for (int64_t c = 0; c < inter; c += kLanes) {
        const mask16 m = first_n(inter - c);
        const vf g = load16(gate + c, m);
        const vf neg_exp = exp16(vsub(vzero(), g));
        const vf silu = vdiv(g, vadd(vset1(1.0f), neg_exp));  // g * sigmoid(g)
        store16(out + r * inter + c, vmul(round_as<T>(silu), load16(up + c, m)), m);
      }
    }
  });
}

void check_activation(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0, op, ": x must be a non-empty CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": dtype must be bfloat16 or float32, got ", x.scalar_type());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_activation(x, "rms_norm");
  const int64_t cols = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols, "rms_norm: weight must be [", cols, "], got ",
              weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(xc);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(xc.data_ptr<T>(), wc.data_ptr<T>(), out.data_ptr<T>(), xc.numel() / cols, cols, float(eps));
  };
  x.scalar_type() == at::kBFloat16 ? run(BFloat16()) : run(float());
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_activation(x, "add_rms_norm");
  const int64_t cols = x.size(-1);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x ", x.sizes(), " ", x.scalar_type(), ", got ", residual.sizes(),
              " ", residual.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols, "add_rms_norm: weight must be [", cols, "], got ",
              weight.sizes());
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.to(x.scalar_type()).contiguous();
  at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(xc.data_ptr<T>(), rc.data_ptr<T>(), wc.data_ptr<T>(), sum.data_ptr<T>(), out.data_ptr<T>(),
                         xc.numel() / cols, cols, float(eps));
  };
  x.scalar_type() == at::kBFloat16 ? run(BFloat16()) : run(float());
  return {out, sum};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_activation(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dim (gate and up) must be even, got ", gate_up.size(-1));
  const at::Tensor xc = gate_up.contiguous();
  const int64_t inter = xc.size(-1) / 2;
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, xc.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(xc.data_ptr<T>(), out.data_ptr<T>(), xc.numel() / (2 * inter), inter);
  };
  xc.scalar_type() == at::kBFloat16 ? run(BFloat16()) : run(float());
  return out;
}

}  // namespace zq

TORCH_LIBRARY_IMPL(zeroqueue, CPU, m) {
  m.impl("rms_norm", &zq::rms_norm);
  m.impl("add_rms_norm", &zq::add_rms_norm);
  m.impl("silu_mul", &zq::silu_mul);
}
