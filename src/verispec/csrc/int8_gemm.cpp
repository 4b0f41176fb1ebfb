// W8A8 linear for small inputs (decode and verify forwards: a few tokens): int8 weights with one
// scale per output channel, activations quantised to uint8 per row (token) inside the op, integer
// dot products (AVX-512 VNNI, or AVX2), a float epilogue, over all of ATen's threads.
//
// Why per row: FBGEMM's dynamic-quantised linear (torch.ao) quantises the whole input with one
// scale, so a token's result depends on the other tokens of the forward; a verify over T tokens
// would then not compute what T one-token decodes compute. Here each row gets its own scale and
// zero point, the integer sums are exact (int32), and the epilogue reads only that row's numbers
// with the same instructions for every row: a row's output is bit-identical whatever else is in
// the input (T, batch) and whatever the thread count.
//
// Why not FBGEMM's int8 GEMM: measured on SmolLM2-135M's shapes it grows with T as fast as the fp16
// kernel (its blocking is built for large M). This kernel streams each block of 16 output
// channels once per pass of up to 8 rows, and re-reads it from L1 for further rows.
//
// Exactness needs the dot products not to saturate: AVX2's vpmaddubsw adds pairs of u8*s8 products
// in int16, exact only when activations stay below 128 (qmax = 127); AVX-512 VNNI's vpdpbusd
// accumulates in int32 and the full 0..255 range is exact. isa() says which path runs; the caller
// passes the matching qmax (a wrong one is refused).
//
// Packed layout (uint8 tensor, 64-byte aligned at meta[4]): for each block of 16 output channels,
// for each group of 4 input columns, 16 lanes x 4 codes (64 bytes); K padded to a multiple of 4 and
// N to a multiple of 16 with zeros. meta = [K, N, Kp, Np, offset].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "op_util.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int64_t kAlign = 64;
constexpr int kLanes = 16;      // output channels per block
constexpr int kRows = 8;        // rows per pass (accumulators held in registers)

enum class Isa { None = 0, Avx2 = 1, Avx512Vnni = 2 };

Isa detect() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx2_only = verispec::avx2_forced("VERISPEC_INT8_ISA");      // tests
    if (!avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      return Isa::Avx512Vnni;
    return verispec::has_avx2_fma() ? Isa::Avx2 : Isa::None;
  }();
  return isa;
}

std::string isa_name() {
  switch (detect()) {
    case Isa::Avx512Vnni: return "avx512_vnni";
    case Isa::Avx2: return "avx2";
    default: return "none";
  }
}

int64_t qmax_for_isa() { return detect() == Isa::Avx512Vnni ? 255 : 127; }

std::vector<at::Tensor> pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(),
              "int8 pack: codes must be a 2-D int8 CPU tensor (out, in), got ", q.scalar_type(), " ", q.sizes());
  auto w = q.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n > 0 && k > 0, "int8 pack: empty weight");
  const int64_t kp = (k + 3) / 4 * 4, np = (n + kLanes - 1) / kLanes * kLanes;
  auto buf = at::zeros({np * kp + kAlign}, at::kByte);
  const auto base = reinterpret_cast<uintptr_t>(buf.data_ptr());
  const int64_t offset = static_cast<int64_t>((kAlign - base % kAlign) % kAlign);
  int8_t* dst = reinterpret_cast<int8_t*>(buf.data_ptr<uint8_t>() + offset);
  const int8_t* src = w.data_ptr<int8_t>();
  for (int64_t c = 0; c < n; ++c) {
    const int64_t nb = c / kLanes, lane = c % kLanes;
    for (int64_t j = 0; j < k; ++j) {
      dst[((nb * (kp / 4) + j / 4) * kLanes + lane) * 4 + j % 4] = src[c * k + j];
    }
  }
  auto colsum = at::zeros({np}, at::kInt);                 // padded channels: 0
  colsum.narrow(0, 0, n).copy_(w.to(at::kInt).sum(1, false, at::kInt));
  auto meta = at::tensor({k, n, kp, np, offset}, at::kLong);
  return {buf, meta, colsum};
}

// Row i of x -> uint8 codes (padded with the row's zero point to kp), scale and zero point;
// 0 is exactly representable. The same scalar code for every row.
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t kp, int qmax, uint8_t* q,
                   float* scale, int32_t* zp) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* r = x + i * k;
    float lo = 0.f, hi = 0.f;
    for (int64_t j = 0; j < k; ++j) { lo = std::min(lo, r[j]); hi = std::max(hi, r[j]); }
    float s = (hi - lo) / static_cast<float>(qmax);
    if (!(s > 0.f) || !std::isfinite(s)) s = 1.f;
    const float zf = std::min<float>(qmax, std::max<float>(0.f, std::nearbyint(-lo / s)));
    const float inv = 1.f / s;
    uint8_t* o = q + i * kp;
    for (int64_t j = 0; j < k; ++j) {
      const float v = std::nearbyint(r[j] * inv) + zf;
      o[j] = static_cast<uint8_t>(std::min<float>(qmax, std::max<float>(0.f, v)));
    }
    for (int64_t j = k; j < kp; ++j) o[j] = static_cast<uint8_t>(zf);   // pad: weights are 0 there
    scale[i] = s;
    zp[i] = static_cast<int32_t>(zf);
  }
}

struct Args {
  const uint8_t* a;       // [rows, kp] codes
  const float* sa;        // [rows]
  const int32_t* za;      // [rows]
  const int8_t* w;        // packed
  const int32_t* cs;      // [np] column sums of the codes (0-padded)
  const float* ws;        // [np] weight scales
  const float* bias;      // [np] or null
  float* out;             // [rows, n]
  int64_t rows, n, kp;
};

// out[i, c] = sa[i] * ws[c] * (acc[i, c] - za[i] * cs[c]) (+ bias[c]), 16 channels at a time.
// One out-of-line function (and -ffp-contract=off) so every row, whatever block kernel summed it,
// gets the same float instructions.
__attribute__((noinline)) void epilogue(const Args& g, int64_t i, int64_t c0, const int32_t* acc) {
  const int64_t lim = std::min<int64_t>(kLanes, g.n - c0);
  for (int64_t l = 0; l < lim; ++l) {
    const int64_t c = c0 + l;
    const float v = (g.sa[i] * g.ws[c]) * static_cast<float>(acc[l] - g.za[i] * g.cs[c]);
    g.out[i * g.n + c] = g.bias ? v + g.bias[c] : v;
  }
}

// R rows x B blocks of 16 channels: per group of 4 input columns, B loads of 64 bytes of weights,
// R broadcasts of 4 activation codes, R*B dot products (int32 accumulators in registers).
template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void block_vnni(const Args& g, int64_t nb, int64_t i0) {
  __m512i acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_si512();
  const int64_t groups = g.kp / 4;
  const int8_t* wp = g.w + nb * groups * kLanes * 4;
  const int64_t wstride = groups * kLanes * 4;            // bytes from one block to the next
  const int32_t* a32 = reinterpret_cast<const int32_t*>(g.a + i0 * g.kp);
  const int64_t astride = g.kp / 4;
  for (int64_t kb = 0; kb < groups; ++kb) {
    __m512i w[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b)
      w[b] = _mm512_load_si512(reinterpret_cast<const void*>(wp + b * wstride + kb * kLanes * 4));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(a32[r * astride + kb]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], a, w[b]);
    }
  }
  alignas(64) int32_t lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      _mm512_store_si512(reinterpret_cast<void*>(lanes), acc[r][b]);
      epilogue(g, i0 + r, (nb + b) * kLanes, lanes);
    }
  }
}

// The same with AVX2: a 64-byte group of weights is two 32-byte halves; vpmaddubsw sums pairs in
// int16 (exact for activation codes below 128), vpmaddwd against ones widens to int32.
template <int R, int B>
__attribute__((target("avx2,fma")))
void block_avx2(const Args& g, int64_t nb, int64_t i0) {
  static_assert(B == 1, "AVX2 path: one block per pass (16 registers)");
  __m256i lo[R], hi[R];
  for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_si256(); hi[r] = _mm256_setzero_si256(); }
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = g.kp / 4;
  const int8_t* wp = g.w + nb * groups * kLanes * 4;
  const int32_t* a32 = reinterpret_cast<const int32_t*>(g.a + i0 * g.kp);
  const int64_t astride = g.kp / 4;
  for (int64_t kb = 0; kb < groups; ++kb) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + kb * kLanes * 4));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + kb * kLanes * 4 + 32));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_set1_epi32(a32[r * astride + kb]);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w0), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w1), ones));
    }
  }
  alignas(32) int32_t lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lo[r]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), hi[r]);
    epilogue(g, i0 + r, nb * kLanes, lanes);
  }
}

using BlockFn = void (*)(const Args&, int64_t, int64_t);

// (kernel, blocks it covers) for rows_left rows starting at block nb of nblocks
std::pair<BlockFn, int> pick(int rows_left, int64_t blocks_left) {
  static const BlockFn vnni2[kRows] = {block_vnni<1, 2>, block_vnni<2, 2>, block_vnni<3, 2>, block_vnni<4, 2>,
                                       block_vnni<5, 2>, block_vnni<6, 2>, block_vnni<7, 2>, block_vnni<8, 2>};
  static const BlockFn vnni1[kRows] = {block_vnni<1, 1>, block_vnni<2, 1>, block_vnni<3, 1>, block_vnni<4, 1>,
                                       block_vnni<5, 1>, block_vnni<6, 1>, block_vnni<7, 1>, block_vnni<8, 1>};
  static const BlockFn avx2[kRows] = {block_avx2<1, 1>, block_avx2<2, 1>, block_avx2<3, 1>, block_avx2<4, 1>,
                                      block_avx2<5, 1>, block_avx2<6, 1>, block_avx2<7, 1>, block_avx2<8, 1>};
  const int r = std::min(rows_left, kRows) - 1;
  if (detect() != Isa::Avx512Vnni) return {avx2[r], 1};
  return blocks_left >= 2 ? std::make_pair(vnni2[r], 2) : std::make_pair(vnni1[r], 1);
}

void run_blocks(const Args& g, int64_t nb_begin, int64_t nb_end) {
  for (int64_t nb = nb_begin; nb < nb_end;) {
    int step = 1;
    for (int64_t i0 = 0; i0 < g.rows; i0 += kRows) {
      auto [fn, covered] = pick(static_cast<int>(g.rows - i0), nb_end - nb);
      fn(g, nb, i0);
      step = covered;
    }
    nb += step;
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                  const at::Tensor& colsum, const at::Tensor& wscale, const c10::optional<at::Tensor>& bias,
                  int64_t qmax, int64_t max_threads) {
  TORCH_CHECK(detect() != Isa::None, "int8 linear: this CPU has neither AVX2 nor AVX-512 VNNI");
  TORCH_CHECK(meta.numel() == 5 && meta.scalar_type() == at::kLong && meta.device().is_cpu(),
              "int8 linear: meta must be int64 [K, N, Kp, Np, offset]");
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t k = m[0], n = m[1], kp = m[2], np = m[3], offset = m[4];
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.numel() >= offset + np * kp,
              "int8 linear: packed buffer too small for its meta");
  const uint8_t* wbase = buf.data_ptr<uint8_t>() + offset;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(wbase) % kAlign == 0,
              "int8 linear: packed buffer lost its alignment (was it copied?)");
  TORCH_CHECK(qmax == qmax_for_isa(), "int8 linear: qmax ", qmax, " does not match this CPU's kernel (",
              isa_name(), " needs ", qmax_for_isa(), ")");
  TORCH_CHECK(colsum.numel() == np && colsum.scalar_type() == at::kInt && colsum.is_contiguous(),
              "int8 linear: colsum must be contiguous int32 [", np, "]");
  TORCH_CHECK(wscale.numel() == np && wscale.scalar_type() == at::kFloat && wscale.is_contiguous(),
              "int8 linear: wscale must be contiguous float32 [", np, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->numel() == np && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "int8 linear: bias must be contiguous float32 [", np, "]");
  }
  // plain variables, not a structured binding: lambdas below capture them (C++17)
  const verispec::LinearIO io = verispec::linear_io(x, k, n, "int8 linear");
  const at::Tensor& xc = io.x;
  at::Tensor out = io.out;
  const int64_t rows = io.rows;
  if (rows == 0) return out;
  auto qa = at::empty({rows * kp + kAlign}, at::kByte);
  auto sa = at::empty({rows}, at::kFloat);
  auto za = at::empty({rows}, at::kInt);
  quantize_rows(xc.data_ptr<float>(), rows, k, kp, static_cast<int>(qmax), qa.data_ptr<uint8_t>(),
                sa.data_ptr<float>(), za.data_ptr<int32_t>());
  Args g{qa.data_ptr<uint8_t>(), sa.data_ptr<float>(), za.data_ptr<int32_t>(),
         reinterpret_cast<const int8_t*>(wbase), colsum.data_ptr<int32_t>(), wscale.data_ptr<float>(),
         has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), rows, n, kp};
  const int64_t blocks = np / kLanes;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({max_threads, at::get_num_threads(), blocks}));
  if (threads == 1 || at::in_parallel_region()) {
    run_blocks(g, 0, blocks);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        run_blocks(g, blocks * t / threads, blocks * (t + 1) / threads);
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(verispec_int8, m) {
  m.def("linear(Tensor x, Tensor buf, Tensor meta, Tensor colsum, Tensor wscale, Tensor? bias, int qmax, "
        "int max_threads, int out_features) -> Tensor");
}

// Through torch's dispatcher (torch.ops.verispec_int8.linear): what a compiled graph calls.
TORCH_LIBRARY_IMPL(verispec_int8, CPU, m) {
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                      const at::Tensor& colsum, const at::Tensor& wscale, const c10::optional<at::Tensor>& bias,
                      int64_t qmax, int64_t max_threads, int64_t out_features) {
    return verispec::with_out_features(linear(x, buf, meta, colsum, wscale, bias, qmax, max_threads),
                                       out_features, "int8 linear");
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("pack", &pack, "pack int8 codes (out, in): returns (buffer, meta, colsum)");
  mod.def("linear", &linear, "x @ W.T (+ bias), activations quantised per row, over up to max_threads threads");
  mod.def("isa", &isa_name, "the dot-product path this CPU runs: avx512_vnni, avx2 or none");
  mod.def("qmax", &qmax_for_isa, "the activation code range that path is exact for");
}
