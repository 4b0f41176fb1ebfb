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
// The query heads of one kv head that share a mask row run together (``group512``): a block of
// keys (16 KiB) is read once and scored for every one of them, then their softmaxes, then the
// values block by block; each row still runs its own instructions in the same order, so grouping
// changes no bit. Scores are formed 16 keys at a time: each key's lane products reduced by one
// transposing butterfly (the same tree for every key), which needs half the shuffles of a
// reduction per key.
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

constexpr int64_t kMaxGroup = 8;     // query rows run together over one kv head's keys

// What the rows of one group share: the K/V of one kv head and one mask row (so one slot list).
struct Keys {
  const float* k;                     // key j at k + j * ks
  const float* v;
  const bool* mask;                   // slot s at mask[s * ms]
  int64_t d, s, ks, vs, ms;
  float scale;
  const int64_t* table = nullptr;     // paged: slot j lives at element offset
  int64_t shift = 0;                  //   table[j >> shift] * bstride + (j & (2^shift - 1)) * sstride (ks = vs = 1)
  int64_t bstride = 0, sstride = 0;
};

// One query row of a group: q [D] and its output [D].
struct Row {
  const float* q;
  float* out;
};

// The visible slots in slot order: their slot numbers (element offsets in the pool when paged)
// into idx[0..n). Returns n.
int64_t list_slots(const Keys& kv, int64_t* idx) {
  int64_t n = 0;
  if (kv.table == nullptr) {
    for (int64_t j = 0; j < kv.s; ++j) {
      if (kv.mask[j * kv.ms]) idx[n++] = j;
    }
  } else {                                      // paged: one table read a block, in the same scan
    const int64_t bs = int64_t{1} << kv.shift;
    for (int64_t j0 = 0, blk = 0; j0 < kv.s; j0 += bs, ++blk) {
      const int64_t end = std::min(bs, kv.s - j0);
      int64_t off = kv.table[blk] * kv.bstride;
      for (int64_t o = 0; o < end; ++o, off += kv.sstride) {
        if (kv.mask[(j0 + o) * kv.ms]) idx[n++] = off;
      }
    }
  }
  return n;
}

// Keys a block: the rows of a group take turns over one block of keys (or values), 16 KiB of
// them, so the block is read from memory once for the group and from L1 by the other rows. A
// multiple of 16, so the 16-key score blocks never straddle two key blocks.
inline int64_t key_block(int64_t d) { return std::max<int64_t>(16, 4096 / d / 16 * 16); }

// A group whose rows see no key: zeros.
inline bool blind(const Keys& kv, const Row* rows, int g, int64_t n) {
  if (n > 0) return false;
  for (int r = 0; r < g; ++r) std::fill(rows[r].out, rows[r].out + kv.d, 0.f);
  return true;
}

// The one fixed reduction of 16 lane sums (pairwise, the same tree on every path).
inline float reduce16(const float* x) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// Sixteen dot products at once: acc[j] holds key j's 16 lane products (its FMAs over the head
// dimension, 16 lanes at a time), and a transposing butterfly adds each key's lanes in the same
// tree, whatever its place among the sixteen: ((l0+l2)+(l1+l3)) per 4 lanes, then the four
// quarter sums pairwise. Returns the 16 dots in key order.
__attribute__((target("avx512f"))) inline __m512 reduce16x16(const __m512* acc) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)          // keys 2i, 2i+1 interleaved: lanes l and l+2 of each quarter
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                         _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {        // keys 4i..4i+3, each quarter's sum of its 4 lanes
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)          // keys 8i..8i+7: quarters 0+1 and 2+3
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// Scores of the listed keys [j0, j0 + 16) for one row, -inf past n.
template <int NV>
__attribute__((target("avx512f"))) inline void score16_512(const Keys& kv, const float* q, const int64_t* idx,
                                                           int64_t j0, int64_t n, int64_t nv, float* sc) {
  __m512 acc[16];
  const int64_t m = std::min<int64_t>(16, n - j0);
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= m) { acc[j] = _mm512_setzero_ps(); continue; }
    const float* kk = kv.k + idx[j0 + j] * kv.ks;
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kk));
    for (int64_t i = 1; i < (NV > 0 ? NV : nv); ++i)
      x = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), _mm512_loadu_ps(kk + 16 * i), x);
    acc[j] = x;
  }
  const __m512 dots = _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(kv.scale));
  const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1u);
  _mm512_storeu_ps(sc + j0, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), dots));
}

// p = exp(s - max) in place over the padded scores; returns 1 / sum.
__attribute__((target("avx512f"))) float softmax512(float* sc, int64_t padded) {
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
  return 1.f / reduce16(lanes);
}

// One row's sum of p_j v_j over the keys [b0, b1), added in key order onto acc [D] (kept in memory
// between blocks: exact).
template <int NV>
__attribute__((target("avx512f"))) inline void pv512(const Keys& kv, const float* p, const int64_t* idx, int64_t b0,
                                                     int64_t b1, int64_t nv, float* accp) {
  __m512 acc[NV > 0 ? NV : 16];
  for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) acc[i] = _mm512_loadu_ps(accp + 16 * i);
  for (int64_t j = b0; j < b1; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* vv = kv.v + idx[j] * kv.vs;
    for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) acc[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vv + 16 * i), acc[i]);
  }
  for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) _mm512_storeu_ps(accp + 16 * i, acc[i]);
}

// A group of g rows over one slot list: scores a key block at a time for every row, then each
// row's softmax, then the values a key block at a time for every row. sc: g rows of ``stride``
// floats; accs: g x D floats. Every row runs the same instructions whatever g and the other rows.
template <int NV>
__attribute__((target("avx512f"))) void group512(const Keys& kv, const Row* rows, int g, float* sc, int64_t stride,
                                                 int64_t* idx, float* accs) {
  const int64_t n = list_slots(kv, idx);
  if (blind(kv, rows, g, n)) return;
  const int64_t d = kv.d, nv = d / 16, padded = (n + 15) / 16 * 16, blk = key_block(d);
  for (int64_t b0 = 0; b0 < n; b0 += blk)
    for (int r = 0; r < g; ++r)
      for (int64_t j0 = b0; j0 < std::min(n, b0 + blk); j0 += 16) score16_512<NV>(kv, rows[r].q, idx, j0, n, nv, sc + r * stride);
  float inv[kMaxGroup];
  for (int r = 0; r < g; ++r) inv[r] = softmax512(sc + r * stride, padded);
  std::fill(accs, accs + g * d, 0.f);
  for (int64_t b0 = 0; b0 < n; b0 += blk)
    for (int r = 0; r < g; ++r) pv512<NV>(kv, sc + r * stride, idx, b0, std::min(n, b0 + blk), nv, accs + r * d);
  for (int r = 0; r < g; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    for (int64_t i = 0; i < nv; ++i)
      _mm512_storeu_ps(rows[r].out + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(accs + r * d + 16 * i), s));
  }
}

__attribute__((target("avx2,fma"))) float dot256(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// The AVX2 twin of softmax512: two 8-lane halves stand for the 16 lanes, the same sums, the same
// reduction.
__attribute__((target("avx2,fma"))) float softmax256(float* sc, int64_t padded) {
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
  return 1.f / reduce16(lanes);
}

template <int NV>
__attribute__((target("avx2,fma"))) inline void pv256(const Keys& kv, const float* p, const int64_t* idx, int64_t b0,
                                                      int64_t b1, int64_t nv, float* accp) {
  __m256 acc[NV > 0 ? NV : 32];
  for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) acc[i] = _mm256_loadu_ps(accp + 8 * i);
  for (int64_t j = b0; j < b1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vv = kv.v + idx[j] * kv.vs;
    for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vv + 8 * i), acc[i]);
  }
  for (int64_t i = 0; i < (NV > 0 ? NV : nv); ++i) _mm256_storeu_ps(accp + 8 * i, acc[i]);
}

// group512 on AVX2: one dot per key (8 lanes, one fixed reduction), the same key blocks.
template <int NV>
__attribute__((target("avx2,fma"))) void group256(const Keys& kv, const Row* rows, int g, float* sc, int64_t stride,
                                                  int64_t* idx, float* accs) {
  const int64_t n = list_slots(kv, idx);
  if (blind(kv, rows, g, n)) return;
  const int64_t d = kv.d, nv = d / 8, padded = (n + 15) / 16 * 16, blk = key_block(d);
  for (int64_t b0 = 0; b0 < n; b0 += blk)
    for (int r = 0; r < g; ++r) {
      float* s = sc + r * stride;
      for (int64_t j = b0; j < std::min(n, b0 + blk); ++j) s[j] = dot256(rows[r].q, kv.k + idx[j] * kv.ks, d) * kv.scale;
    }
  float inv[kMaxGroup];
  for (int r = 0; r < g; ++r) {
    std::fill(sc + r * stride + n, sc + r * stride + padded, -std::numeric_limits<float>::infinity());
    inv[r] = softmax256(sc + r * stride, padded);
  }
  std::fill(accs, accs + g * d, 0.f);
  for (int64_t b0 = 0; b0 < n; b0 += blk)
    for (int r = 0; r < g; ++r) pv256<NV>(kv, sc + r * stride, idx, b0, std::min(n, b0 + blk), nv, accs + r * d);
  for (int r = 0; r < g; ++r) {
    const __m256 s = _mm256_set1_ps(inv[r]);
    for (int64_t i = 0; i < nv; ++i)
      _mm256_storeu_ps(rows[r].out + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(accs + r * d + 8 * i), s));
  }
}

// The group routine for this CPU and head dimension (templated for the common ones).
using GroupFn = void (*)(const Keys&, const Row*, int, float*, int64_t, int64_t*, float*);
GroupFn group_fn(int64_t d) {
  if (detect() == Isa::Avx512) return d == 64 ? group512<4> : d == 128 ? group512<8> : group512<0>;
  return d == 64 ? group256<8> : d == 128 ? group256<16> : group256<0>;
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
// block table's mapping when ``table`` is given). Rows of one (batch row, kv head, token) that
// share their mask row (a mask [B, 1, T, S]) run as groups of up to kMaxGroup query heads; groups
// are halved while there are fewer than two a thread. Work units are split evenly over threads.
at::Tensor run_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    double scale, int64_t max_threads, int64_t kvh, int64_t s, const int64_t kstr[3],
                    const int64_t vstr[3], const int64_t* table, int64_t table_stride, int64_t shift,
                    int64_t bstride = 0, int64_t sstride = 0) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  TORCH_CHECK(kvh > 0 && h % kvh == 0, "attention: ", h, " query heads are not a multiple of ", kvh, " kv heads");
  auto out = at::empty({b, t, h, d}, q.options());
  if (b * h * t == 0) return out.permute({0, 2, 1, 3});
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kvh;
  const bool shared = mask.size(1) == 1;
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>({max_threads, at::get_num_threads(), b * h * t}));
  int64_t sub = shared ? std::min<int64_t>(group, kMaxGroup) : 1;          // rows a unit
  auto units_of = [&](int64_t rows_per) { return b * kvh * t * ((group + rows_per - 1) / rows_per); };
  while (sub > 1 && units_of(sub) < 2 * cap) sub = (sub + 1) / 2;
  const int64_t chunks = (group + sub - 1) / sub, units = units_of(sub);
  const GroupFn fn = group_fn(d);
  auto run = [&](int64_t begin, int64_t end) {
    const int64_t stride = (s + 15) / 16 * 16 + 16;
    std::vector<float> sc(sub * stride), accs(sub * d);
    std::vector<int64_t> slots(s + 1);
    Row rows[kMaxGroup];
    for (int64_t u = begin; u < end; ++u) {            // unit u: (bi, kh, ti, chunk)
      const int64_t c = u % chunks, ti = u / chunks % t, kh = u / (chunks * t) % kvh, bi = u / (chunks * t * kvh);
      const int64_t h0 = kh * group + c * sub, g = std::min(sub, (kh + 1) * group - h0);
      const int64_t mh = shared ? 0 : h0;
      const Keys kv{kp + bi * kstr[0] + kh * kstr[1], vp + bi * vstr[0] + kh * vstr[1],
                    mp + bi * mask.stride(0) + mh * mask.stride(1) + ti * mask.stride(2), d, s, kstr[2], vstr[2],
                    mask.stride(3), static_cast<float>(scale), table == nullptr ? nullptr : table + bi * table_stride,
                    shift, bstride, sstride};
      for (int64_t r = 0; r < g; ++r)
        rows[r] = Row{qp + bi * q.stride(0) + (h0 + r) * q.stride(1) + ti * q.stride(2),
                      op + ((bi * t + ti) * h + h0 + r) * d};
      fn(kv, rows, static_cast<int>(g), sc.data(), stride, slots.data(), accs.data());
    }
  };
  const int64_t threads = std::min(cap, units);
  if (threads == 1 || at::in_parallel_region()) {
    run(0, units);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t th = begin; th < end; ++th) run(units * th / threads, units * (th + 1) / threads);
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
