// Row-invariant attention for small inputs (decode and verify forwards): every query row (batch,
// head, token) computes its output from the keys its mask lets it see, in slot order, with the
// same instructions whatever the other rows, the token count T or the thread count.
//
// Why: a speculative step verifies T tokens in one forward and must compute, for the accepted
// ones, what T one-token decodes compute. The matmuls of a packed model are row-invariant
// (fp16 / int4 / int8 ops); torch's scaled_dot_product_attention is not: its kernels block the
// queries and keys differently for T = 1 and T > 1, so a token's attention output moves in its last
// bits between a decode and a verify. A model whose activations are rounded to fewer bits (int8
// codes, bf16) amplifies those bits into different logits, and greedy speculation then drifts from
// greedy decoding on near-ties. With this op, the whole forward of a token is bit-identical in a
// decode and a verify (the mask shows a verify row the prompt and its tree ancestors, in slot
// order: the same keys with the same values a decode sees).
//
// Per row: the visible slots' scores s_j = scale * (q . k_j) (dot product over the head dimension
// in vector lanes, one fixed reduction), m = max_j s_j (vector max: exact in any order),
// p_j = exp(s_j - m) (one vector exp routine over the compacted scores; padding lanes are zero),
// l = sum_j p_j (lane j mod W accumulates its slots in order, then one fixed reduction of the W
// lanes: the same steps for every row of a given visible count), out = (sum_j p_j v_j) * (1 / l),
// the sum over j in order, vectorised over the head dimension. The visible slots are listed once
// per row (one pass over the mask). A row that sees no key gets zeros.
//
// Inputs: q [B, H, T, D], k and v [B, KVH, S, D] (any strides with the last dim contiguous),
// mask [B, 1 or H, T, S] bool (any strides); H a multiple of KVH (grouped-query attention), D a
// multiple of 16. Output [B, H, T, D] float32, a transposed view of a contiguous [B, T, H, D]
// (so out.transpose(1, 2).reshape(B, T, H * D) makes no copy).
// paged_attention: the same rows over K/V pools of a paged cache ([blocks, KVH, bs, D]) and
// a block table per batch row; slot j maps to a physical slot, then everything above is unchanged.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "op_util.h"

namespace {

enum class Isa { None = 0, Avx2 = 1, Avx512 = 2 };

Isa detect() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx2_only = verispec::avx2_forced("VERISPEC_ATTN_ISA");      // tests
    if (!avx2_only && __builtin_cpu_supports("avx512f")) return Isa::Avx512;
    return verispec::has_avx2_fma() ? Isa::Avx2 : Isa::None;
  }();
  return isa;
}

std::string isa_name() {
  switch (detect()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "none";
  }
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial, 2^n by exponent bits; relative
// error about 2e-7; below -87 it returns 0).
#define VS_EXP_BODY(V, SET1, FMA, FNMA, MUL, ROUND, CVT, ADDI, SLLI, CAST, CMPLT, BLEND0)         \
  const V lo = SET1(-87.0f);                                                                   \
  const V n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                      \
  V r = FNMA(n, SET1(0.693359375f), x);                                                        \
  r = FNMA(n, SET1(-2.12194440e-4f), r);                                                       \
  V p = SET1(1.0f / 720);                                                                      \
  p = FMA(p, r, SET1(1.0f / 120));                                                             \
  p = FMA(p, r, SET1(1.0f / 24));                                                              \
  p = FMA(p, r, SET1(1.0f / 6));                                                               \
  p = FMA(p, r, SET1(0.5f));                                                                   \
  p = FMA(p, r, SET1(1.0f));                                                                   \
  p = FMA(p, r, SET1(1.0f));                                                                   \
  const V two_n = CAST(SLLI(ADDI(CVT(n), 127), 23));                                           \
  const V e = MUL(p, two_n);                                                                   \
  return BLEND0(CMPLT(x, lo), e);

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
#define R512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADDI512(a, b) _mm512_add_epi32(a, _mm512_set1_epi32(b))
#define CMPLT512(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define BLEND512(m, e) _mm512_mask_blend_ps(m, e, _mm512_setzero_ps())
  VS_EXP_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, R512,
              _mm512_cvtps_epi32, ADDI512, _mm512_slli_epi32, _mm512_castsi512_ps, CMPLT512, BLEND512)
}

__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
#define R256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADDI256(a, b) _mm256_add_epi32(a, _mm256_set1_epi32(b))
#define CMPLT256(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define BLEND256(m, e) _mm256_blendv_ps(e, _mm256_setzero_ps(), m)
  VS_EXP_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, R256,
              _mm256_cvtps_epi32, ADDI256, _mm256_slli_epi32, _mm256_castsi256_ps, CMPLT256, BLEND256)
}

struct Row {
  const float* q;                     // [D]
  const float* k;                     // key j at k + j * ks
  const float* v;
  const bool* mask;                   // slot s at mask[s * ms]
  float* out;                         // [D]
  int64_t d, s, ks, vs, ms;
  float scale;
  const int64_t* table = nullptr;     // paged: slot j lives at element offset
  int64_t shift = 0;                  //   table[j >> shift] * bstride + (j & (2^shift - 1)) * sstride (ks = vs = 1)
  int64_t bstride = 0, sstride = 0;
};

// Scores of the visible slots, compacted (slot order) into sc[0..n), padded with -inf to a
// multiple of 16; their slot numbers (element offsets in the pool when paged) into idx[0..n). Returns n.
template <typename Dot>
int64_t scores(const Row& r, float* sc, int64_t* idx, Dot dot) {
  int64_t n = 0;
  if (r.table == nullptr) {
    for (int64_t j = 0; j < r.s; ++j) {
      if (r.mask[j * r.ms]) idx[n++] = j;
    }
  } else {                                      // paged: one table read a block, in the same scan
    const int64_t bs = int64_t{1} << r.shift;
    for (int64_t j0 = 0, blk = 0; j0 < r.s; j0 += bs, ++blk) {
      const int64_t end = std::min(bs, r.s - j0);
      int64_t off = r.table[blk] * r.bstride;
      for (int64_t o = 0; o < end; ++o, off += r.sstride) {
        if (r.mask[(j0 + o) * r.ms]) idx[n++] = off;
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) sc[i] = dot(r.q, r.k + idx[i] * r.ks, r.d) * r.scale;
  for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) sc[j] = -std::numeric_limits<float>::infinity();
  return n;
}

// The scalar steps every path shares: a row that sees no key gets zeros; the max and the sum of
// the compacted scores, left to right.
inline bool blind_row(const Row& r, int64_t n) {
  if (n > 0) return false;
  for (int64_t i = 0; i < r.d; ++i) r.out[i] = 0.f;
  return true;
}

// The one fixed reduction of 16 lane sums (pairwise, the same tree on every path).
inline float reduce16(const float* x) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}


__attribute__((target("avx512f"))) float dot512(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) void row512(const Row& r, float* sc, int64_t* idx) {
  const int64_t n = scores(r, sc, idx, dot512);
  if (blind_row(r, n)) return;
  const int64_t d = r.d, padded = (n + 15) / 16 * 16;
  __m512 mx = _mm512_loadu_ps(sc);                   // padding lanes are -inf
  for (int64_t j = 16; j < padded; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j));
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv));   // padding: exp(-inf) = 0
    _mm512_storeu_ps(sc + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  const float l = reduce16(lanes);
  __m512 acc[16];                                   // D <= 256
  const int64_t nv = d / 16;
  for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = _mm512_set1_ps(sc[j]);
    const float* vv = r.v + idx[j] * r.vs;
    for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vv + 16 * i), acc[i]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / l);
  for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(r.out + 16 * i, _mm512_mul_ps(acc[i], inv));
}

__attribute__((target("avx2,fma"))) float dot256(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

__attribute__((target("avx2,fma"))) void row256(const Row& r, float* sc, int64_t* idx) {
  const int64_t n = scores(r, sc, idx, dot256);
  if (blind_row(r, n)) return;
  const int64_t d = r.d, padded = (n + 15) / 16 * 16;
  // two 8-lane halves stand for the 16 lanes of the AVX-512 path: the same sums, the same reduction
  __m256 mx = _mm256_max_ps(_mm256_loadu_ps(sc), _mm256_loadu_ps(sc + 8));
  for (int64_t j = 16; j < padded; j += 16)
    mx = _mm256_max_ps(mx, _mm256_max_ps(_mm256_loadu_ps(sc + j), _mm256_loadu_ps(sc + j + 8)));
  alignas(32) float m8[8];
  _mm256_store_ps(m8, mx);
  const __m256 mv = _mm256_set1_ps(*std::max_element(m8, m8 + 8));
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __m256 a = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
    const __m256 b = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j + 8), mv));
    _mm256_storeu_ps(sc + j, a);
    _mm256_storeu_ps(sc + j + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  const float l = reduce16(lanes);
  __m256 acc[32];
  const int64_t nv = d / 8;
  for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(sc[j]);
    const float* vv = r.v + idx[j] * r.vs;
    for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vv + 8 * i), acc[i]);
  }
  const __m256 inv = _mm256_set1_ps(1.f / l);
  for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(r.out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

void check_q_mask(const at::Tensor& q, const at::Tensor& mask, int64_t s) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.device().is_cpu() && q.dim() == 4 && q.stride(3) == 1,
              "attention: q must be float32 CPU [B, heads, T, D] with a contiguous last dim");
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  TORCH_CHECK(d % 16 == 0 && d <= 256, "attention: head dimension ", d, " must be a multiple of 16, at most 256");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4, "attention: mask must be bool [B, 1|H, T, S]");
  TORCH_CHECK(mask.size(0) == b && (mask.size(1) == 1 || mask.size(1) == h) && mask.size(2) == t &&
              mask.size(3) == s, "attention: mask ", mask.sizes(), " does not match [", b, ", 1|", h, ", ", t,
              ", ", s, "]");
}

// Runs every (batch, head, token) row. Key/value slot j of batch row bi, kv head kh is at
// base + bi * batch_stride + kh * head_stride + phys(j) * slot_stride (phys: identity, or the
// block table's mapping when ``table`` is given).
at::Tensor run_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    double scale, int64_t max_threads, int64_t kvh, int64_t s, const int64_t kstr[3],
                    const int64_t vstr[3], const int64_t* table, int64_t table_stride, int64_t shift,
                    int64_t bstride = 0, int64_t sstride = 0) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  TORCH_CHECK(kvh > 0 && h % kvh == 0, "attention: ", h, " query heads are not a multiple of ", kvh, " kv heads");
  auto out = at::empty({b, t, h, d}, q.options());
  const int64_t rows = b * h * t;
  if (rows == 0) return out.permute({0, 2, 1, 3});
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kvh;
  const bool wide = detect() == Isa::Avx512;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> sc((s + 16) / 16 * 16 + 16);
    std::vector<int64_t> slots(s + 1);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t bi = idx / (h * t), hi = idx / t % h, ti = idx % t;
      const int64_t kh = hi / group, mh = mask.size(1) == 1 ? 0 : hi;
      Row r{qp + bi * q.stride(0) + hi * q.stride(1) + ti * q.stride(2),
            kp + bi * kstr[0] + kh * kstr[1], vp + bi * vstr[0] + kh * vstr[1],
            mp + bi * mask.stride(0) + mh * mask.stride(1) + ti * mask.stride(2),
            op + ((bi * t + ti) * h + hi) * d, d, s, kstr[2], vstr[2], mask.stride(3),
            static_cast<float>(scale), table == nullptr ? nullptr : table + bi * table_stride, shift, bstride,
            sstride};
      if (wide) row512(r, sc.data(), slots.data()); else row256(r, sc.data(), slots.data());
    }
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({max_threads, at::get_num_threads(), rows}));
  if (threads == 1 || at::in_parallel_region()) {
    run(0, rows);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t th = begin; th < end; ++th) run(rows * th / threads, rows * (th + 1) / threads);
    });
  }
  return out.permute({0, 2, 1, 3});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scale, int64_t max_threads) {
  TORCH_CHECK(detect() != Isa::None, "attention: this CPU has neither AVX2 nor AVX-512");
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu() && x->dim() == 4 && x->stride(3) == 1,
                "attention: q, k, v must be float32 CPU [B, heads, len, D] with a contiguous last dim");
  }
  const int64_t b = q.size(0), d = q.size(3), kvh = k.size(1), s = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == kvh && v.size(2) == s && k.size(3) == d &&
              v.size(3) == d, "attention: k and v must be [", b, ", KVH, S, ", d, "], got ", k.sizes(), " and ",
              v.sizes());
  check_q_mask(q, mask, s);
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  return run_rows(q, k, v, mask, scale, max_threads, kvh, s, ks, vs, nullptr, 0, 0);
}

// Paged: k and v are pools [blocks, KVH, bs, D] (bs = 2^shift slots a block, the same strides,
// last dim contiguous: a block's keys of one head lie together); table [B, MB] int64 maps slot j
// of batch row b to block table[b][j / bs], slot j % bs of it; the mask's S <= MB * bs slots are
// attended. The same instructions as ``attention`` over the same keys in the same order:
// bit-identical results.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                           const at::Tensor& mask, double scale, int64_t shift, int64_t max_threads) {
  TORCH_CHECK(detect() != Isa::None, "attention: this CPU has neither AVX2 nor AVX-512");
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu() && x->dim() == 4 && x->stride(3) == 1,
                "paged_attention: k, v must be float32 CPU pools [blocks, KVH, block size, D] with a contiguous "
                "last dim");
  }
  const int64_t b = q.size(0), d = q.size(3), kvh = k.size(1), s = mask.size(3);
  TORCH_CHECK(shift >= 0 && shift < 16 && k.size(2) == (int64_t{1} << shift), "paged_attention: block size 2^",
              shift, " does not match pools ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes() && v.strides() == k.strides() && k.size(3) == d, "paged_attention: pools ",
              k.sizes(), " and ", v.sizes(), " must have the same layout and head dimension ", d);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == b && table.stride(1) == 1 &&
              (table.size(1) << shift) >= s, "paged_attention: table ", table.sizes(), " must be int64 [", b,
              ", >= ", s, " slots / block] with a contiguous last dim");
  check_q_mask(q, mask, s);
  const int64_t ks[3] = {0, k.stride(1), 1}, vs[3] = {0, v.stride(1), 1};     // offsets come from the table
  return run_rows(q, k, v, mask, scale, max_threads, kvh, s, ks, vs, table.data_ptr<int64_t>(), table.stride(0),
                  shift, k.stride(0), k.stride(2));
}

}  // namespace

TORCH_LIBRARY(verispec_attn, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, int max_threads) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor mask, float scale, int shift, "
        "int max_threads) -> Tensor");
}

// Through torch's dispatcher (torch.ops.verispec_attn.attention): what a compiled graph calls.
TORCH_LIBRARY_IMPL(verispec_attn, CPU, m) {
  m.impl("attention", &attention);
  m.impl("paged_attention", &paged_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("attention", &attention, "row-invariant attention of q [B,H,T,D] over k, v [B,KVH,S,D] under a bool mask");
  mod.def("paged_attention", &paged_attention, "attention over K/V pools [blocks,KVH,bs,D] through a block table");
  mod.def("isa", &isa_name, "the path this CPU runs: avx512, avx2 or none");
}
