// The bf16-dot form of the extend attention's tiles, for bf16 K/V pools on CPUs with AVX512_BF16.
//
// Why: with a bf16 pool the fp32 tiles widen every K/V element and run one fp32 FMA per
// multiply-add; vdpbf16ps does two bf16 multiply-adds per fp32 lane (32 per zmm instruction, into
// fp32 accumulators), twice the FMA's work per instruction. Both products take pairs along their
// reduction dimension:
// - S = Q K^T: Q rows (times the softmax scale) are rounded to bf16 and read as pairs of head_dim
//   (one uint32 broadcast per row); the key block is stored [Dp / 2][kKeys] of uint32 pairs, which
//   is the fp32 tile's 16x16 transpose applied to the pool rows' 32-bit words, no conversion.
// - O += P V: the softmax weights are rounded to bf16 and read as pairs of keys; the value block is
//   stored [kKeys / 2][Dp] of pairs (row 2i in the low half, 2i + 1 in the high half).
// Numerics: K and V are the pool's values exactly; Q * scale and P are rounded to bf16 (relative
// error 2^-9 each), the products and sums are fp32, the softmax (max, exp, running sum l) stays fp32
// on fp32 scores, its exp to a relative 5e-5 (exp16_bf16_weights, common.h: below P's rounding). This is what a bf16 engine computes (vLLM's CPU backend, SGLang's AMX kernels);
// fp32 pools keep the exact fp32 tiles (extend_attention_tile.h).
#pragma once

#include "extend_attention_tile.h"

#if RS_HAVE_AVX512 && defined(__AVX512BF16__)
#define RS_HAVE_EXTEND_BF16 1
#else
#define RS_HAVE_EXTEND_BF16 0
#endif

#if RS_HAVE_EXTEND_BF16

namespace extend_tile {

// uint32 pairs per row of a packed bf16 query (head_dim padded to Dp, a multiple of 16).
inline int64_t pairs(int64_t Dp) { return Dp / 2; }

// The key tile's pair rows rounded up to whole 16x16 transposes (the rows past Dp / 2 are zeros
// the product never reads).
inline int64_t key_pair_rows(int64_t Dp) { return (pairs(Dp) + 15) / 16 * 16; }

// C[r][c * 16 + x] (=, or * row_scale[r] +=) sum over k < K of the bf16 pairs A[r][k] . B[k][c * 16 + x]:
// tile_kernel's register blocking with vdpbf16ps in place of the FMA.
template <int MR, int NR, bool kAccumulate>
inline void tile_kernel_bf16(const uint32_t* __restrict A, int64_t lda, const uint32_t* __restrict B, int64_t ldb,
                             int64_t K, float* __restrict C, int64_t ldc, const float* row_scale) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512 s = kAccumulate ? _mm512_set1_ps(row_scale[r]) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = kAccumulate ? _mm512_mul_ps(_mm512_loadu_ps(C + r * ldc + c * 16), s) : s;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512bh b[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) b[c] = (__m512bh)_mm512_loadu_si512(B + k * ldb + c * 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(A[r * lda + k]));
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) _mm512_storeu_ps(C + r * ldc + c * 16, acc[r][c]);
}

template <int NR, bool kAccumulate>
inline void row_blocks_bf16(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t K, float* C,
                            int64_t ldc, int64_t M, const float* row_scale) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) {
    tile_kernel_bf16<kRows, NR, kAccumulate>(A + r * lda, lda, B, ldb, K, C + r * ldc, ldc, row_scale + r);
  }
  const uint32_t* a = A + r * lda;
  float* c = C + r * ldc;
  const float* s = row_scale + r;
  switch (M - r) {
    case 1: tile_kernel_bf16<1, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 2: tile_kernel_bf16<2, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 3: tile_kernel_bf16<3, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 4: tile_kernel_bf16<4, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 5: tile_kernel_bf16<5, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    default: break;
  }
}

// tile_gemm over pairs: C [M][N] (=, or * row_scale +=) A [M][K pairs] B [K pairs][N], N a multiple of 16.
template <bool kAccumulate>
void tile_gemm_bf16(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                    int64_t M, int64_t N, const float* row_scale) {
  for (int64_t c0 = 0; c0 < N;) {
    const int64_t left = (N - c0) / 16;
    if (left >= 4) {
      row_blocks_bf16<4, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += 64;
    } else if (left >= 2) {
      row_blocks_bf16<2, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += 32;
    } else {
      row_blocks_bf16<1, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += 16;
    }
  }
}

// Rounds n floats (a multiple of 16) to bf16, in order: out holds n / 2 pairs.
inline void round_row_bf16(const float* x, int64_t n, uint32_t* out) {
  for (int64_t j = 0; j < n; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
  }
}

// qb [Dp / 2] pairs = bf16(scale * q), head_dim zero-padded to Dp.
inline void pack_query_row_bf16(const float* q, int64_t D, int64_t Dp, float scale, uint32_t* qb) {
  alignas(64) float tmp[512];
  pack_query_row(q, D, Dp, scale, tmp);
  round_row_bf16(tmp, Dp, qb);
}

// The first min(n, 16) lanes.
inline __mmask16 low_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Kt [key_pair_rows(Dp)][kKeys] pairs: pair i of K rows slots[0..n) (head_dim 2i, 2i + 1), columns
// n up to the next 16 and rows past D / 2 zeros.
inline void pack_keys_t_bf16(const at::BFloat16* k, int64_t row_stride, const int32_t* slots, int64_t n, int64_t D,
                             uint32_t* kt) {
  const int64_t P = D / 2;  // pairs per pool row (D is a multiple of 8)
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    for (int64_t i0 = 0; i0 < P; i0 += 16) {
      const __mmask16 valid = low_lanes(P - i0);
      __m512 r[16];
      for (int64_t t = 0; t < 16; ++t) {
        r[t] = j0 + t < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
                                valid, k + static_cast<int64_t>(slots[j0 + t]) * row_stride + 2 * i0))
                          : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int64_t x = 0; x < 16; ++x) _mm512_storeu_ps(reinterpret_cast<float*>(kt + (i0 + x) * kKeys + j0), r[x]);
    }
  }
}

// Vt [kKeys / 2][Dp] pairs: (V[slots[2i]][d], V[slots[2i + 1]][d]) for the rows of slots[0..n);
// the second row of an odd n and head_dim D..Dp are zeros (their weights may be non-zero padding).
inline void pack_values_bf16(const at::BFloat16* v, int64_t row_stride, const int32_t* slots, int64_t n, int64_t D,
                             int64_t Dp, uint32_t* vt) {
  for (int64_t j = 0; j < n; j += 2) {
    const at::BFloat16* lo = v + static_cast<int64_t>(slots[j]) * row_stride;
    const at::BFloat16* hi = j + 1 < n ? v + static_cast<int64_t>(slots[j + 1]) * row_stride : nullptr;
    for (int64_t d0 = 0; d0 < Dp; d0 += 16) {
      const __mmask16 valid = low_lanes(D - d0);
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, lo + d0));
      const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, hi + d0)) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + (j / 2) * Dp + d0, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

}  // namespace extend_tile

#endif  // RS_HAVE_EXTEND_BF16
