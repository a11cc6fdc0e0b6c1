// The tile operations of the CPU extend (prefill) attention: packing a query tile and a block of
// keys/values gathered from the paged pool, the two register-blocked products (S = Q K^T and
// O = O * alpha + P V) and the online-softmax step between them. AVX-512 or AVX2, through the
// Vec wrapper of attention_block.h.
#pragma once

#include "attention_block.h"
#include "common.h"

#if RS_HAVE_AVX2

namespace extend_tile {

constexpr int64_t kKeys = 64;  // keys per block: one AVX-512 row of 4 registers in the S product
constexpr int kRows = 6;       // rows per register block (6 x 4 zmm, or 6 x 2 ymm, accumulators)
#if RS_HAVE_AVX512
constexpr int kMaxCols = 4;  // vectors per register block: 6 x 4 accumulators + 4 B + 1 A of 32
#else
constexpr int kMaxCols = 2;  // 6 x 2 + 2 + 1 of the 16 ymm registers
#endif

// Loads floats [0, valid) of p, zeros past it (valid < kWidth only on an AVX-512 build with a head
// dim that is a multiple of 8 but not of 16): the zeros pad head_dim up to a whole register.
inline Vec::reg load_part(const float* p, int64_t valid) {
#if RS_HAVE_AVX512
  if (valid < Vec::kWidth) return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), p);
#endif
  return Vec::load(p);
}

// load_part for a quantized or 16-bit pool row: whole registers convert in place; a partial one
// (the head_dim tail on AVX-512) goes through a zero-padded float copy.
template <typename kv_t>
inline Vec::reg load_part(const kv_t* p, int64_t valid) {
  if (valid >= Vec::kWidth) return Vec::load_kv(p);
  alignas(64) float tmp[Vec::kWidth] = {};
  for (int64_t i = 0; i < valid; ++i) tmp[i] = to_float(p[i]);
  return Vec::load(tmp);
}

// C[r][c * W + x] for r < MR, c < NR over K steps:
//   kAccumulate false: C = A B
//   kAccumulate true:  C = C * row_scale[r] + A B  (the online-softmax rescale, fused in the load)
// A is row-major [MR][lda], B is [K][ldb]: each step broadcasts MR scalars of A against NR
// vectors of B, so the MR x NR accumulators stay in registers for the whole K loop.
template <int MR, int NR, bool kAccumulate>
inline void tile_kernel(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb, int64_t K,
                        float* __restrict C, int64_t ldc, const float* row_scale) {
  constexpr int64_t W = Vec::kWidth;
  Vec::reg acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const Vec::reg s = kAccumulate ? Vec::set1(row_scale[r]) : Vec::zero();
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = kAccumulate ? Vec::mul(Vec::load(C + r * ldc + c * W), s) : s;
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec::reg b[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) b[c] = Vec::load(B + k * ldb + c * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec::reg a = Vec::set1(A[r * lda + k]);
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) acc[r][c] = Vec::fma(a, b[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) Vec::store(C + r * ldc + c * W, acc[r][c]);
}

template <int NR, bool kAccumulate>
inline void row_blocks(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                       int64_t M, const float* row_scale) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) {
    tile_kernel<kRows, NR, kAccumulate>(A + r * lda, lda, B, ldb, K, C + r * ldc, ldc, row_scale + r);
  }
  const float* a = A + r * lda;
  float* c = C + r * ldc;
  const float* s = row_scale + r;
  switch (M - r) {  // the last rows of a tile whose row count is not a multiple of kRows
    case 1: tile_kernel<1, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 2: tile_kernel<2, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 3: tile_kernel<3, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 4: tile_kernel<4, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    case 5: tile_kernel<5, NR, kAccumulate>(a, lda, B, ldb, K, c, ldc, s); break;
    default: break;
  }
}

// C [M][N] (=, or * row_scale +=) A [M][K] B [K][N]; N is a multiple of Vec::kWidth. Column
// panels are the outer loop so that one panel of B stays in L1 while every row block reads it.
template <bool kAccumulate>
void tile_gemm(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc, int64_t M,
               int64_t N, const float* row_scale) {
  constexpr int64_t W = Vec::kWidth;
  for (int64_t c0 = 0; c0 < N;) {
    const int64_t left = (N - c0) / W;
    if (kMaxCols >= 4 && left >= 4) {
      row_blocks<kMaxCols >= 4 ? 4 : 2, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += 4 * W;
    } else if (left >= 2) {
      row_blocks<2, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += 2 * W;
    } else {
      row_blocks<1, kAccumulate>(A, lda, B + c0, ldb, K, C + c0, ldc, M, row_scale);
      c0 += W;
    }
  }
}

// Kt [Dp][kKeys]: K rows slots[0..n) of one KV head (at k + slot * row_stride) transposed, so that
// the S product reads whole registers of consecutive keys. Columns n up to the next whole register
// and rows D.. are zeros. Rows are dequantized here (an int8 pool's rows times their k_scale, at
// k_scale + slot * scale_stride; nullptr: no scale), so the products only ever see fp32.
template <typename kv_t>
inline void pack_keys_t(const kv_t* k, int64_t row_stride, const float* k_scale, int64_t scale_stride,
                        const int32_t* slots, int64_t n, int64_t D, int64_t Dp, float* kt) {
  constexpr int64_t W = Vec::kWidth;
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    for (int64_t d0 = 0; d0 < Dp; d0 += W) {
      Vec::reg r[W];
      for (int64_t t = 0; t < W; ++t) {
        if (j0 + t >= n) {
          r[t] = Vec::zero();
          continue;
        }
        r[t] = load_part(k + static_cast<int64_t>(slots[j0 + t]) * row_stride + d0, D - d0);
        if (k_scale) r[t] = Vec::mul(r[t], Vec::set1(row_scale(k_scale, slots[j0 + t], scale_stride)));
      }
#if RS_HAVE_AVX512
      transpose16x16(r);
#else
      transpose8x8(r);
#endif
      for (int64_t x = 0; x < W; ++x) Vec::store(kt + (d0 + x) * kKeys + j0, r[x]);
    }
  }
}

// Vt [n][Dp]: V rows slots[0..n), head_dim zero-padded to Dp, dequantized as pack_keys_t's.
template <typename kv_t>
inline void pack_values(const kv_t* v, int64_t row_stride, const float* v_scale, int64_t scale_stride,
                        const int32_t* slots, int64_t n, int64_t D, int64_t Dp, float* vt) {
  for (int64_t j = 0; j < n; ++j) {
    const kv_t* row = v + static_cast<int64_t>(slots[j]) * row_stride;
    const Vec::reg s = Vec::set1(row_scale(v_scale, slots[j], scale_stride));
    for (int64_t d0 = 0; d0 < Dp; d0 += Vec::kWidth) {
      const Vec::reg x = load_part(row + d0, D - d0);
      Vec::store(vt + j * Dp + d0, v_scale ? Vec::mul(x, s) : x);
    }
  }
}

// Qp [rows][Dp] = scale * q rows (the scale folded in once per query instead of once per score).
inline void pack_query_row(const float* q, int64_t D, int64_t Dp, float scale, float* qp) {
  const Vec::reg s = Vec::set1(scale);
  for (int64_t d0 = 0; d0 < Dp; d0 += Vec::kWidth) Vec::store(qp + d0, Vec::mul(load_part(q + d0, D - d0), s));
}

// max of s[0, nc), nc a multiple of Vec::kWidth.
inline float row_max(const float* s, int64_t nc) {
  Vec::reg m = Vec::load(s);
  for (int64_t j = Vec::kWidth; j < nc; j += Vec::kWidth) {
#if RS_HAVE_AVX512
    m = _mm512_max_ps(m, Vec::load(s + j));
#else
    m = _mm256_max_ps(m, Vec::load(s + j));
#endif
  }
#if RS_HAVE_AVX512
  return _mm512_reduce_max_ps(m);
#else
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
}

// One row's online-softmax step over a block of n keys of which the first `visible` are visible
// (the rest lie past the causal diagonal): s [nc] scores (nc = n rounded up to whole registers)
// become weights p = exp(s - m_new), zero where not visible; l and m are updated. Returns alpha,
// the factor that rescales what the row accumulated so far (1 without an exp when the block does
// not raise the row's max, as most blocks of a long row do not). kBf16Weights: the weights are
// rounded to bf16 next (the bf16-dot tiles), so exp16_bf16_weights computes them.
template <bool kBf16Weights = false>
inline float softmax_row(float* s, int64_t visible, int64_t n, int64_t nc, float& m, float& l) {
  if (visible <= 0) {  // the whole block lies above this row's diagonal
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  if (visible < nc) std::fill(s + visible, s + nc, -std::numeric_limits<float>::infinity());
  const float m_new = std::max(m, row_max(s, nc));
  const float alpha = m_new == m ? 1.f : std::exp(m - m_new);  // 0 for the first block (m = -inf)
  const Vec::reg mv = Vec::set1(m_new);
  Vec::reg sum = Vec::zero();
  for (int64_t j = 0; j < nc; j += Vec::kWidth) {
    const Vec::reg x = Vec::sub(Vec::load(s + j), mv);
#if RS_HAVE_AVX512
    const Vec::reg p = kBf16Weights ? exp16_bf16_weights(x) : Vec::exp(x);
#else
    const Vec::reg p = Vec::exp(x);
#endif
    Vec::store(s + j, p);
    sum = Vec::fma(p, Vec::set1(1.f), sum);
  }
  // exp of -inf is ~1e-38 after exp16's clamp, not 0: zero the hidden weights so that P V
  // matches the reference exactly (their share of the sum is below fp32 resolution).
  if (visible < n) std::fill(s + visible, s + n, 0.f);
  l = l * alpha + Vec::sum(sum);
  m = m_new;
  return alpha;
}

// softmax_row for a block whose visible keys are not a prefix (a draft tree's new tokens):
// vis[j] != 0 marks key j visible. Hidden keys get weight exactly 0.
inline float softmax_row_masked(float* s, const uint8_t* vis, int64_t n, int64_t nc, float& m, float& l) {
  int64_t any = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (vis[j]) {
      any = 1;
    } else {
      s[j] = -std::numeric_limits<float>::infinity();
    }
  }
  if (!any) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  const float alpha = softmax_row(s, n, n, nc, m, l);
  for (int64_t j = 0; j < n; ++j) {
    if (!vis[j]) s[j] = 0.f;
  }
  return alpha;
}

}  // namespace extend_tile

#endif  // RS_HAVE_AVX2
