// Shared by verispec's C++ ops.
#pragma once
#include <torch/extension.h>

#include <cstdlib>
#include <string>

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

// Instruction-set choice shared by the ops' ``detect()``: an op runs its AVX-512 path when the CPU
// has that path's features (each op tests its own list: __builtin_cpu_supports takes literals
// only) and ``force_env`` (e.g. VERISPEC_INT4_ISA) is not "avx2" (tests run the AVX2 path so);
// else its AVX2 path when the CPU has AVX2 and FMA; else none.
inline bool avx2_forced(const char* force_env) {
  const char* force = std::getenv(force_env);
  return force != nullptr && std::string(force) == "avx2";
}

inline bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace verispec
