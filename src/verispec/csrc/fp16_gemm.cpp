// fp16-weight GEMM for small inputs, computed over all of ATen's threads.
//
// torch's fbgemm_linear_fp16_weight calls FBGEMM's fp16 kernel on one thread, so a decode or
// verify forward uses one core for its matmuls. FBGEMM's kernel can split the output's column
// blocks over threads (cblas_gemm_compute's thread_id / num_threads); this op does that inside
// one OpenMP region. Each output element is the same kernel over the same inputs whatever the
// thread count, so the result is bit-identical to one thread and to torch's op.
//
// The packed matrix lives in a plain uint8 tensor (pack() copies FBGEMM's packed buffer into it)
// with its layout in an int64 "meta" tensor, so the op's arguments are tensors only (torch.compile
// and custom-op friendly) and the memory is owned by torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "op_util.h"
#include <fbgemm/FbgemmFP16.h>

#include <algorithm>
#include <cstring>

namespace {

using Packed = fbgemm::PackedGemmMatrixFP16;
constexpr int64_t kMetaLen = 10;   // nrow ncol brow last_brow bcol nbrow nbcol size kncb offset
constexpr int64_t kAlign = 64;

std::vector<at::Tensor> pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "fp16 pack: weight must be 2-D (out, in), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "fp16 pack: weight must be float32 on the CPU");
  auto w = weight.contiguous();
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  TORCH_CHECK(n > 0 && k > 0, "fp16 pack: empty weight");
  Packed p(fbgemm::matrix_op_t::Transpose, k, n, 1.0f, w.data_ptr<float>());
  const int64_t bytes = static_cast<int64_t>(p.matSize()) * static_cast<int64_t>(sizeof(fbgemm::float16));
  auto buf = at::empty({bytes + kAlign}, at::kByte);
  const auto base = reinterpret_cast<uintptr_t>(buf.data_ptr());
  const int64_t offset = static_cast<int64_t>((kAlign - base % kAlign) % kAlign);
  std::memcpy(buf.data_ptr<uint8_t>() + offset, p.pmat(), bytes);
  auto meta = at::tensor({int64_t(p.numRows()), int64_t(p.numCols()), int64_t(p.blockRowSize()),
                          int64_t(p.lastBrow()), int64_t(p.blockColSize()), int64_t(p.numBrow()),
                          int64_t(p.numBcol()), int64_t(p.matSize()), int64_t(p.kernelNumColBlocks()),
                          offset}, at::kLong);
  return {buf, meta};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                  const c10::optional<at::Tensor>& bias, int64_t max_threads) {
  TORCH_CHECK(meta.numel() == kMetaLen && meta.scalar_type() == at::kLong, "fp16 linear: bad meta");
  const int64_t* m = meta.data_ptr<int64_t>();
  TORCH_CHECK(buf.numel() >= m[9] + m[7] * 2, "fp16 linear: packed buffer too small for its meta");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr<uint8_t>() + m[9]) % kAlign == 0,
              "fp16 linear: packed buffer lost its alignment (was it copied?)");
  auto i = [m](int j) { return static_cast<int>(m[j]); };
  Packed p(i(0), i(1), i(2), i(3), i(4), i(5), i(6), static_cast<uint64_t>(m[7]), i(8),
           const_cast<uint8_t*>(buf.data_ptr<uint8_t>()) + m[9]);
  const int k = p.numRows(), n = p.numCols();
  // plain variables, not a structured binding: lambdas below capture them (C++17)
  const verispec::LinearIO io = verispec::linear_io(x, k, n, "fp16 linear");
  const at::Tensor& xc = io.x;
  at::Tensor out = io.out;
  const int64_t rows = io.rows;
  if (rows == 0) return out;
  const float* a = xc.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(
      std::min<int64_t>(max_threads, at::get_num_threads()), p.numBcol())));
  if (threads == 1 || at::in_parallel_region()) {
    fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, int(rows), a, p, 0.0f, c, 0, 1);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, int(rows), a, p, 0.0f, c,
                                   int(t), threads);
      }
    });
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "fp16 linear: bias has ", bias->numel(), " elements, want ", n);
    out.add_(*bias);
  }
  return out;
}

}  // namespace

// The op through torch's dispatcher too (torch.ops.verispec_fp16.linear): a compiled graph calls it
// directly, without a Python custom op's dispatch (~15 us a call, ~120 calls a step).
TORCH_LIBRARY(verispec_fp16, m) {
  m.def("linear(Tensor x, Tensor buf, Tensor meta, Tensor? bias, int max_threads, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec_fp16, CPU, m) {
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                      const c10::optional<at::Tensor>& bias, int64_t max_threads, int64_t out_features) {
    return verispec::with_out_features(linear(x, buf, meta, bias, max_threads), out_features, "fp16 linear");
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("pack", &pack, "pack a float32 (out, in) weight: returns (buffer, meta)");
  mod.def("linear", &linear, "x @ W.T (+ bias) over up to max_threads threads");
}
