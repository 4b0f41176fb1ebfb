#pragma once
// W4A8 for csrc/int4_gemm.cpp (its linear_a8), included inside that file's anonymous namespace
// after the layout's constants (kLanes, kGroup, kCodeBytes, kGroupBytes) and its shared helpers
// (scales_512/256, store_512/256).
//
// The same packed codes, with each row's inputs quantised to int8 per group of 32 columns
// (symmetric: d = max|x| / 127, xi = round(x / d)), as llama.cpp's Q8 activations are. The code x
// input products are exact integer dot products (vpdpbusd: 4 u8 x s8 products a lane), then per
// group, with s, zz = z - 8 s the group's weight scale and offset and S = sum_j xi_j:
//     t = float(sum_j q_j xi_j) * s;  t = zz * S + t;  y[c] = t * d + y[c]
// in that order, groups in order. The integer sums are exact, so the AVX2 path (vpmaddubsw pairs
// in int16, exact for |xi| <= 127) gives the same bits as the AVX-512 one, and a row's result
// never depends on the other rows. A 32-bit word of the layout holds columns 0,2,4,6 (low half)
// and 1,3,5,7 (high half), so its low nibbles are columns 0,4,1,5 and its high nibbles 2,6,3,7:
// each group of 8 inputs is stored in that order.
//
// Why: the bf16 path's dot products (32 products an instruction, plus decoding codes to bf16)
// bound a verify or a prefill; vpdpbusd does 64 and the codes need only a mask and a shift. All
// matmuls of a Qwen2.5-1.5B forward, 2 threads, bf16 path -> this one: T=1 21.7 -> 19.8 ms, T=4
// 30.7 -> 25.6, T=8 60.8 -> 42.0, T=177 854 -> 557 (benchmarks/results/weight_kernels_a8.md).
struct ArgsA8 {
  const uint32_t* xq;     // [rows, k / 4]: int8 inputs, 4 a word, in the codes' nibble order
  const float* xd;        // [rows, groups]: each group's input scale d
  const float* xsum;      // [rows, groups]: each group's sum of its int8 inputs (exact)
  const uint8_t* w;
  const float* bias;
  float* out;
  int64_t rows, n, k, groups;
};

// One row's groups quantised (AVX2, whichever path multiplies: the same bits on both): d =
// max|x| / 127 (exact max), xi = round-to-nearest-even(x * (127 / max|x|)) clamped to +-127,
// written 8 columns at a time in the codes' nibble order; S the exact integer sum.
__attribute__((target("avx2,fma")))
void prepare_row_a8(const float* x, int64_t groups, int8_t* xq, float* xd, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const float* r = x + g * kGroup;
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(r));
    for (int c = 8; c < kGroup; c += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + c)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = lanes[0];
    for (int l = 1; l < 8; ++l) amax = std::max(amax, lanes[l]);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < kGroup; c += 8) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(r + c), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(top, _mm256_max_ps(bottom, v));
      const __m256i q = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(v), order);
      sum = _mm256_add_epi32(sum, q);
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + g * kGroup + c), _mm_packs_epi16(q16, q16));
    }
    alignas(32) int32_t s8[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
    xd[g] = amax / 127.f;
    xsum[g] = static_cast<float>(s8[0] + s8[1] + s8[2] + s8[3] + s8[4] + s8[5] + s8[6] + s8[7]);
  }
}

// Every row, in parallel over rows when there are many (rows are independent).
void prepare_rows_a8(const float* x, int64_t rows, int64_t k, int8_t* xq, float* xd, float* xsum) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      prepare_row_a8(x + i * k, groups, xq + i * k, xd + i * groups, xsum + i * groups);
  });
}

// R rows x one block of 16 channels with AVX-512 VNNI: a 64-byte chunk (8 columns of 16 channels)
// gives two code vectors (low and high nibbles), each 4 columns a lane, for vpdpbusd.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void block_vnni(const ArgsA8& a, int64_t nb, int64_t i0) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wb = a.w + nb * a.groups * kGroupBytes;
  const int64_t quarter_k = a.k / 4;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
    const uint8_t* wg = wb + g * kGroupBytes;
    const uint32_t* xg = a.xq + i0 * quarter_k + g * (kGroup / 4);
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const __m512i v = _mm512_load_si512(reinterpret_cast<const void*>(wg + c * 64));
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        part[r] = _mm512_dpbusd_epi32(part[r], lo, _mm512_set1_epi32(static_cast<int>(xg[r * quarter_k + 2 * c])));
        part[r] = _mm512_dpbusd_epi32(part[r], hi, _mm512_set1_epi32(static_cast<int>(xg[r * quarter_k + 2 * c + 1])));
      }
    }
    __m512 zz;                                                   // z - 8 s
    const __m512 s = scales_512(wg + kCodeBytes, &zz);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (i0 + r) * a.groups + g;
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(part[r]), s);
      t = _mm512_fmadd_ps(zz, _mm512_set1_ps(a.xsum[rg]), t);
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.xd[rg]), acc[r]);
    }
  }
  store_512(a, nb, i0, acc);
}

// The same recipe with AVX2 (no VNNI): vpmaddubsw adds code x input pairs in int16 (exact: at most
// 2 * 15 * 127), vpmaddwd by ones makes them the same int32 sums of 4; a block is two halves of 8.
template <int R>
__attribute__((target("avx2,fma")))
void block_avx2_a8(const ArgsA8& a, int64_t nb, int64_t i0) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* wb = a.w + nb * a.groups * kGroupBytes;
  const int64_t quarter_k = a.k / 4;
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
    const uint8_t* wg = wb + g * kGroupBytes;
    const uint32_t* xg = a.xq + i0 * quarter_k + g * (kGroup / 4);
    for (int c = 0; c < kGroup / 8; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = _mm256_set1_epi32(static_cast<int>(xg[r * quarter_k + 2 * c]));
          const __m256i x1 = _mm256_set1_epi32(static_cast<int>(xg[r * quarter_k + 2 * c + 1]));
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
          part[r][h] = _mm256_add_epi32(part[r][h], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 zz;
      const __m256 s = scales_256(wg + kCodeBytes, h, &zz);
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (i0 + r) * a.groups + g;
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(part[r][h]), s);
        t = _mm256_fmadd_ps(zz, _mm256_set1_ps(a.xsum[rg]), t);
        acc[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.xd[rg]), acc[r][h]);
      }
    }
  }
  store_256(a, nb, i0, acc);
}
