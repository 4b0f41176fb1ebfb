// int4 weight-only linear: 4-bit codes in groups of 32 input columns with a bf16 scale and zero
// point per (output channel, group), activations rounded to bf16, fp32 sums and fp32 output, over
// all of ATen's threads; linear_a8 (int4_a8.h) multiplies the same codes by int8 activations.
//
// Why: torch's int4pack kernel (aten._weight_int4pack_mm_for_cpu) grows with the token count T
// about as fast as a compute-bound GEMM, so a verify over a few draft tokens costs several
// one-token decodes and speculation cannot pay; it also rounds its output to bf16. A decode is
// memory-bound: this kernel decodes a block of codes into registers once per pass of up to 8 rows
// and multiplies two columns at a time with AVX-512 BF16 dot products (vdpbf16ps: 32 products an
// instruction), so a few more rows add dot products, not memory traffic.
//
// Arithmetic, per output channel c and group g (q the codes, s and z the group's scale and zero
// point, the dequantised weight being (q - 8) * s + z, x the bf16-rounded inputs):
//     y[c] += s * (sum_j x_j * q_j) + (z - 8 s) * (sum_j x_j)
// with the inner sums in a fixed order (on AVX-512: column pairs 0 and 2 of each 8-column chunk
// into one partial sum, pairs 1 and 3 into another, chunks in order, then the two added; two
// dependency chains instead of one made a pass of 1-4 rows 10-35% faster) and the groups in
// order. Every row runs the same instructions whatever the other rows, the pass size or the
// thread count (threads split output channels), so a row's result is bit-identical in a decode, a
// verify and a batch. The AVX2 path (CPUs without AVX-512 BF16) computes the same sums with fp32
// multiply-adds, in its own (equally fixed) order.
//
// Packed layout (uint8 tensor, 64-byte aligned at meta[3]): per block of 16 output channels, per
// group of 32 input columns, 4 chunks of 64 bytes (8 columns each: one 32-bit word per channel,
// holding columns 0, 2, 4, 6 in its low 16 bits and 1, 3, 5, 7 in its high 16 bits, 4 bits each),
// then 16 bf16 scales and 16 bf16 zero points: 320 bytes per block and group.
// meta = [K, N, groups, offset].
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
constexpr int kLanes = 16;          // output channels per block
constexpr int kGroup = 32;          // input columns per scale / zero pair
constexpr int kCodeBytes = kGroup / 2 * kLanes;            // 256
constexpr int kGroupBytes = kCodeBytes + 2 * kLanes * 2;   // + bf16 scales and zero points: 320
constexpr int kRows = 8;            // rows per pass

enum class Isa { None = 0, Avx2 = 1, Avx512Bf16 = 2 };

Isa detect() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx2_only = verispec::avx2_forced("VERISPEC_INT4_ISA");      // tests
    if (!avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512bf16"))
      return Isa::Avx512Bf16;
    return verispec::has_avx2_fma() ? Isa::Avx2 : Isa::None;
  }();
  return isa;
}

std::string isa_name() {
  switch (detect()) {
    case Isa::Avx512Bf16: return "avx512_bf16";
    case Isa::Avx2: return "avx2";
    default: return "none";
  }
}

// codes [N, K] uint8 (0..15), scale and zero [N, K/32] bf16 -> (buffer, meta)
std::vector<at::Tensor> pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu(),
              "int4 pack: codes must be a 2-D uint8 CPU tensor (out, in), got ", codes.scalar_type(), " ",
              codes.sizes());
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n % kLanes == 0 && k % kGroup == 0, "int4 pack: the weight's shape ",
              codes.sizes(), " needs out % ", kLanes, " == 0 and in % ", kGroup, " == 0");
  const int64_t groups = k / kGroup;
  for (const auto* t : {&scale, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == n && t->size(1) == groups,
                "int4 pack: scale and zero must be bf16 [", n, ", ", groups, "], got ", t->scalar_type(), " ",
                t->sizes());
  }
  auto q = codes.contiguous();
  auto sc = scale.contiguous(), ze = zero.contiguous();
  TORCH_CHECK(q.max().item<int>() <= 15, "int4 pack: codes must lie in 0..15");
  const int64_t nblocks = n / kLanes;
  auto buf = at::zeros({nblocks * groups * kGroupBytes + kAlign}, at::kByte);
  const auto base = reinterpret_cast<uintptr_t>(buf.data_ptr());
  const int64_t offset = static_cast<int64_t>((kAlign - base % kAlign) % kAlign);
  uint8_t* dst = buf.data_ptr<uint8_t>() + offset;
  const uint8_t* src = q.data_ptr<uint8_t>();
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* z16 = reinterpret_cast<const uint16_t*>(ze.data_ptr<at::BFloat16>());
  for (int64_t nb = 0; nb < nblocks; ++nb) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* blk = dst + (nb * groups + g) * kGroupBytes;
      uint16_t* sz = reinterpret_cast<uint16_t*>(blk + kCodeBytes);
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t c = nb * kLanes + lane;
        const uint8_t* row = src + c * k + g * kGroup;
        for (int ch = 0; ch < kGroup / 8; ++ch) {          // 8 columns per 32-bit word
          uint32_t word = 0;
          for (int i = 0; i < 4; ++i) {
            word |= static_cast<uint32_t>(row[ch * 8 + 2 * i]) << (4 * i);
            word |= static_cast<uint32_t>(row[ch * 8 + 2 * i + 1]) << (16 + 4 * i);
          }
          std::memcpy(blk + ch * 64 + lane * 4, &word, 4);
        }
        sz[lane] = s16[c * groups + g];
        sz[kLanes + lane] = z16[c * groups + g];
      }
    }
  }
  auto meta = at::tensor({k, n, groups, offset}, at::kLong);
  return {buf, meta};
}

struct Args {
  const uint32_t* x2;     // [rows, k / 2]: bf16 pairs (even column in the low half)
  const float* xsum;      // [rows, groups]: each group's sum of the bf16 inputs, left to right
  const uint8_t* w;       // packed
  const float* bias;      // [n] or null
  float* out;             // [rows, n]
  int64_t rows, n, k, groups;
};

inline uint16_t to_bf16(float f) {            // round to nearest even, as torch's .bfloat16()
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);   // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Inputs rounded to bf16 (pairs of columns in one 32-bit word) and each group's sum of them, one
// scalar loop per row: the same bits for every row.
void prepare_rows(const float* x, int64_t rows, int64_t k, uint32_t* x2, float* xsum) {
  const int64_t groups = k / kGroup;
  for (int64_t i = 0; i < rows; ++i) {
    const float* r = x + i * k;
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int j = 0; j < kGroup; j += 2) {
        const uint16_t a = to_bf16(r[g * kGroup + j]), b = to_bf16(r[g * kGroup + j + 1]);
        x2[(i * k + g * kGroup + j) / 2] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
        s += from_bf16(a);
        s += from_bf16(b);
      }
      xsum[i * groups + g] = s;
    }
  }
}

// One block's 16 outputs of row i (+ bias), for either recipe's arguments.
template <class A>
__attribute__((noinline)) void store(const A& a, int64_t i, int64_t c0, const float* lanes) {
  float* o = a.out + i * a.n + c0;
  for (int l = 0; l < kLanes; ++l) o[l] = a.bias ? lanes[l] + a.bias[c0 + l] : lanes[l];
}

// A group's 16 bf16 scales s (returned) and z - 8 s (in *zz), from its packed scale/zero pairs.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 scales_512(const uint8_t* sz, __m512* zz) {
  const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sz))), 16));
  const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sz + 2 * kLanes))), 16));
  *zz = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
  return s;
}

// The same for half h (8 channels) of the block, AVX2.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 scales_256(const uint8_t* sz, int h, __m256* zz) {
  const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sz + h * 16))), 16));
  const __m256 z = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sz + 2 * kLanes + h * 16))), 16));
  *zz = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);
  return s;
}

// R rows of one block's fp32 accumulators written out.
template <class A, int R>
__attribute__((target("avx512f"), always_inline)) inline void store_512(const A& a, int64_t nb, int64_t i0,
                                                                        const __m512 (&acc)[R]) {
  alignas(64) float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(lanes, acc[r]);
    store(a, i0 + r, nb * kLanes, lanes);
  }
}

template <class A, int R>
__attribute__((target("avx2"), always_inline)) inline void store_256(const A& a, int64_t nb, int64_t i0,
                                                                     const __m256 (&acc)[R][2]) {
  alignas(32) float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    store(a, i0 + r, nb * kLanes, lanes);
  }
}

// R rows x one block of 16 channels with AVX-512 BF16: a 64-byte chunk holds 8 columns of the 16
// channels (one 32-bit word per channel); shifting it by 4 i bits puts column pair i's codes in
// the low 5 bits of each 16-bit half, and vpermw maps them to bf16 values (the table repeats 0..15
// so the fifth bit does not matter); vdpbf16ps multiplies a pair of columns by a pair of inputs.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void block_bf16(const Args& a, int64_t nb, int64_t i0) {
  alignas(64) static const uint16_t tab[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
      0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(reinterpret_cast<const void*>(tab));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wb = a.w + nb * a.groups * kGroupBytes;
  const int64_t half_k = a.k / 2;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 part[R], part2[R];                                   // pairs 0, 2 / 1, 3 of each chunk
    for (int r = 0; r < R; ++r) part[r] = part2[r] = _mm512_setzero_ps();
    const uint8_t* wg = wb + g * kGroupBytes;
    const uint32_t* xg = a.x2 + i0 * half_k + g * (kGroup / 2);
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const __m512i v = _mm512_load_si512(reinterpret_cast<const void*>(wg + c * 64));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i w = _mm512_permutexvar_epi16(i == 0 ? v : _mm512_srli_epi32(v, 4 * i), table);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xp = _mm512_set1_epi32(static_cast<int>(xg[r * half_k + c * 4 + i]));
          if (i & 1) part2[r] = _mm512_dpbf16_ps(part2[r], (__m512bh)w, (__m512bh)xp);
          else part[r] = _mm512_dpbf16_ps(part[r], (__m512bh)w, (__m512bh)xp);
        }
      }
    }
    __m512 zz;                                                   // z - 8 s
    const __m512 s = scales_512(wg + kCodeBytes, &zz);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(part[r], part2[r]), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[(i0 + r) * a.groups + g]), zz, acc[r]);
    }
  }
  store_512(a, nb, i0, acc);
}

// The same numbers' recipe with AVX2 and fp32 multiply-adds (CPUs without AVX-512 BF16): a block
// is two halves of 8 channels; per column pair, the even column then the odd one.
template <int R>
__attribute__((target("avx2,fma")))
void block_avx2(const Args& a, int64_t nb, int64_t i0) {
  const __m256i mask = _mm256_set1_epi32(15);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* wb = a.w + nb * a.groups * kGroupBytes;
  const int64_t half_k = a.k / 2;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    const uint8_t* wg = wb + g * kGroupBytes;
    const uint32_t* xg = a.x2 + i0 * half_k + g * (kGroup / 2);
    for (int c = 0; c < kGroup / 8; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + h * 32));
        for (int i = 0; i < 4; ++i) {
          const __m256 we = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * i), mask));
          const __m256 wo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16 + 4 * i), mask));
          for (int r = 0; r < R; ++r) {
            const uint32_t p = xg[r * half_k + c * 4 + i];
            part[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(from_bf16(static_cast<uint16_t>(p))), we, part[r][h]);
            part[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(from_bf16(static_cast<uint16_t>(p >> 16))), wo, part[r][h]);
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 zz;
      const __m256 s = scales_256(wg + kCodeBytes, h, &zz);
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(part[r][h], s, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(a.xsum[(i0 + r) * a.groups + g]), zz, acc[r][h]);
      }
    }
  }
  store_256(a, nb, i0, acc);
}

#include "int4_a8.h"      // linear_a8's row preparation and kernels

// The most rows a pass holds in registers (AVX-512: 2 R accumulators + a code vector or two +
// constants, of 32 registers; AVX2: one block of two halves, 2 rows). A pass takes one block of
// 16 channels: the blocks are contiguous, so the pass reads memory as one sequential stream.
// Passes over 2 or 4 blocks at once (sharing each input broadcast) were slower on the 2-core EPYC:
// Qwen-1.5B's decoder matmuls, W4A8, T=1 19.6 -> 18.6 ms, T=2 23.2 -> 20.4, T=4 29.4 -> 24.2.
int max_rows(bool avx2) { return avx2 ? 2 : kRows; }

// The kernel for a pass of `rows` rows, from the AVX-512 variants <R> and the AVX2 ones <R> of one
// recipe.
template <class A, template <int> class Wide, template <int> class Narrow>
struct Kernels {
  using Fn = void (*)(const A&, int64_t, int64_t);
  static Fn pick(bool avx2, int rows) {
    if (avx2) return rows == 2 ? Narrow<2>::fn : Narrow<1>::fn;
    static const Fn wide[kRows] = {Wide<1>::fn, Wide<2>::fn, Wide<3>::fn, Wide<4>::fn,
                                   Wide<5>::fn, Wide<6>::fn, Wide<7>::fn, Wide<8>::fn};
    return wide[rows - 1];
  }
};

template <int R> struct Bf16 { static constexpr auto fn = block_bf16<R>; };
template <int R> struct Avx2 { static constexpr auto fn = block_avx2<R>; };
template <int R> struct Vnni { static constexpr auto fn = block_vnni<R>; };
template <int R> struct Avx2A8 { static constexpr auto fn = block_avx2_a8<R>; };

// Blocks [nb_begin, nb_end), one at a time: the first row pass reads it from memory, later passes
// from cache.
template <class K, class A>
void run_blocks(const A& a, bool avx2, int64_t nb_begin, int64_t nb_end) {
  const int most = max_rows(avx2);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    for (int64_t i0 = 0; i0 < a.rows;) {
      const int r = static_cast<int>(std::min<int64_t>(a.rows - i0, most));
      K::pick(avx2, r)(a, nb, i0);
      i0 += r;
    }
  }
}

// A packed weight's meta and buffer, checked.
struct Packed {
  int64_t k, n, groups, nblocks;
  const uint8_t* w;
  const float* bias;
};

Packed unpack(const at::Tensor& buf, const at::Tensor& meta, const c10::optional<at::Tensor>& bias,
              const char* op) {
  TORCH_CHECK(meta.numel() == 4 && meta.scalar_type() == at::kLong && meta.device().is_cpu(),
              op, ": meta must be int64 [K, N, groups, offset]");
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t k = m[0], n = m[1], groups = m[2], offset = m[3];
  const int64_t nblocks = n / kLanes;
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.numel() >= offset + nblocks * groups * kGroupBytes,
              op, ": packed buffer too small for its meta");
  const uint8_t* wbase = buf.data_ptr<uint8_t>() + offset;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(wbase) % kAlign == 0, op,
              ": packed buffer lost its alignment (was it copied?)");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                op, ": bias must be contiguous float32 [", n, "]");
  }
  return {k, n, groups, nblocks, wbase, has_bias ? bias->data_ptr<float>() : nullptr};
}

// Output channels split over up to max_threads of ATen's threads, in blocks.
template <class K, class A>
void run_parallel(const A& a, bool avx2, int64_t nblocks, int64_t max_threads) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({max_threads, at::get_num_threads(), nblocks}));
  if (threads == 1 || at::in_parallel_region()) {
    run_blocks<K>(a, avx2, 0, nblocks);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        run_blocks<K>(a, avx2, nblocks * t / threads, nblocks * (t + 1) / threads);
      }
    });
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                  const c10::optional<at::Tensor>& bias, int64_t max_threads) {
  TORCH_CHECK(detect() != Isa::None, "int4 linear: this CPU has neither AVX2 nor AVX-512");
  const Packed p = unpack(buf, meta, bias, "int4 linear");
  const verispec::LinearIO io = verispec::linear_io(x, p.k, p.n, "int4 linear");
  if (io.rows == 0) return io.out;
  auto x2 = at::empty({io.rows * p.k / 2}, at::kInt);
  auto xsum = at::empty({io.rows, p.groups}, at::kFloat);
  prepare_rows(io.x.data_ptr<float>(), io.rows, p.k, reinterpret_cast<uint32_t*>(x2.data_ptr<int32_t>()),
               xsum.data_ptr<float>());
  Args a{reinterpret_cast<const uint32_t*>(x2.data_ptr<int32_t>()), xsum.data_ptr<float>(), p.w, p.bias,
         io.out.data_ptr<float>(), io.rows, p.n, p.k, p.groups};
  run_parallel<Kernels<Args, Bf16, Avx2>>(a, detect() == Isa::Avx2, p.nblocks, max_threads);
  return io.out;
}

bool a8_avx2() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return verispec::avx2_forced("VERISPEC_INT4_ISA") || !__builtin_cpu_supports("avx512f") ||
           !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vnni");
  }();
  return avx2;
}

at::Tensor linear_a8(const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                     const c10::optional<at::Tensor>& bias, int64_t max_threads) {
  TORCH_CHECK(verispec::has_avx2_fma(), "int4 linear_a8: this CPU has neither AVX2 nor AVX-512");
  const Packed p = unpack(buf, meta, bias, "int4 linear_a8");
  const verispec::LinearIO io = verispec::linear_io(x, p.k, p.n, "int4 linear_a8");
  if (io.rows == 0) return io.out;
  auto xq = at::empty({io.rows * p.k}, at::kChar);
  auto xd = at::empty({io.rows, p.groups}, at::kFloat);
  auto xsum = at::empty({io.rows, p.groups}, at::kFloat);
  prepare_rows_a8(io.x.data_ptr<float>(), io.rows, p.k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                  xsum.data_ptr<float>());
  ArgsA8 a{reinterpret_cast<const uint32_t*>(xq.data_ptr<int8_t>()), xd.data_ptr<float>(), xsum.data_ptr<float>(),
           p.w, p.bias, io.out.data_ptr<float>(), io.rows, p.n, p.k, p.groups};
  run_parallel<Kernels<ArgsA8, Vnni, Avx2A8>>(a, a8_avx2(), p.nblocks, max_threads);
  return io.out;
}

std::string isa_a8_name() { return a8_avx2() ? "avx2" : "avx512_vnni"; }

}  // namespace

TORCH_LIBRARY(verispec_int4, m) {
  m.def("linear(Tensor x, Tensor buf, Tensor meta, Tensor? bias, int max_threads, int out_features) -> Tensor");
  m.def("linear_a8(Tensor x, Tensor buf, Tensor meta, Tensor? bias, int max_threads, int out_features) -> Tensor");
}

// Through torch's dispatcher (torch.ops.verispec_int4.linear / linear_a8): what a compiled graph calls.
TORCH_LIBRARY_IMPL(verispec_int4, CPU, m) {
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                      const c10::optional<at::Tensor>& bias, int64_t max_threads, int64_t out_features) {
    return verispec::with_out_features(linear(x, buf, meta, bias, max_threads), out_features, "int4 linear");
  });
  m.impl("linear_a8", [](const at::Tensor& x, const at::Tensor& buf, const at::Tensor& meta,
                         const c10::optional<at::Tensor>& bias, int64_t max_threads, int64_t out_features) {
    return verispec::with_out_features(linear_a8(x, buf, meta, bias, max_threads), out_features,
                                       "int4 linear_a8");
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("pack", &pack, "pack int4 codes (out, in) with bf16 scale and zero [out, in/32]: (buffer, meta)");
  mod.def("linear", &linear, "x @ W.T (+ bias), fp32 activations rounded to bf16, over up to max_threads threads");
  mod.def("linear_a8", &linear_a8,
          "x @ W.T (+ bias), fp32 activations quantised to int8 per group of 32, over up to max_threads threads");
  mod.def("isa", &isa_name, "the path linear runs on this CPU: avx512_bf16, avx2 or none");
  mod.def("isa_a8", &isa_a8_name, "the path linear_a8 runs on this CPU: avx512_vnni or avx2");
}
