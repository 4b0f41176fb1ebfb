// Shared by verispec's C++ ops.
#pragma once
#include <torch/extension.h>

namespace verispec {

// A dispatcher entry promises its output width (the fake shape registered from Python reads
// out_features); the op's real output is checked against that promise.
inline at::Tensor with_out_features(at::Tensor out, int64_t out_features, const char* op) {
  TORCH_CHECK(out.size(-1) == out_features, op, ": out_features ", out_features,
              " does not match the packed weight's ", out.size(-1));
  return out;
}

// A linear op's input checked (float32 on the CPU, ``k`` features) and made contiguous, its rows
// counted, and its output [..., n] allocated (uninitialised).
struct LinearIO {
  at::Tensor x, out;
  int64_t rows;
};

inline LinearIO linear_io(const at::Tensor& x, int64_t k, int64_t n, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), op, ": float32 CPU input");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": input has ", x.size(-1), " features, the weight takes ", k);
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = n;
  return {xc, at::empty(sizes, xc.options()), xc.numel() / k};
}

}  // namespace verispec
