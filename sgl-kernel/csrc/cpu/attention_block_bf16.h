// The decode attention's block step on bf16 K/V pools with AVX512_BF16: vdpbf16ps in place of
// widening every K/V element to fp32 and one FMA per multiply-add (attention_block.h).
//
// Why: at 8 requests x 2k tokens the K/V a decode step reads outweighs the model's weights, and
// the fp32 block step ran at 0.3 of a plain read of those bytes on Zen 4: compute-bound on the
// widening (two instructions per 16 elements), the separate fp32 copy of each key block and the
// FMAs. Here:
// - scores: each K row is read from the pool as bf16 pairs, one vdpbf16ps per 32 elements against
//   the query (times the softmax scale) rounded to bf16 once per segment; the 16 tokens' partial
//   sums reduced by reduce16x16 as before;
// - values: two V rows interleaved into pairs (vpermt2w) per 32 elements, one vdpbf16ps per query
//   head and 16 outputs against the pair of softmax weights rounded to bf16.
// Numerics: K and V exactly; q * scale and the weights P rounded to bf16 (relative 2^-9 each),
// products and sums fp32, the softmax state (m, l, alpha) fp32 on fp32 scores, the weights' exp to
// a relative 5e-5 (exp16_bf16_weights, below their bf16 rounding): what a bf16 engine computes. fp32 pools keep the exact fp32 step.
#pragma once

#include "attention_block.h"

#if RS_HAVE_AVX512 && defined(__AVX512BF16__)
#define RS_HAVE_DECODE_BF16 1
#else
#define RS_HAVE_DECODE_BF16 0
#endif

#if RS_HAVE_DECODE_BF16

// Whether the bf16-dot step takes this head_dim (whole 32-element registers of a K/V row).
inline bool decode_bf16_applies(int64_t D) { return D % 32 == 0 && D <= kMaxHeadDim; }

// Value chunks (16 outputs each) per pass: G * kNB accumulators + kNB pair registers + the two
// rows, two permute indices and a weight within the 32 registers; even (a permute makes two).
template <int G>
constexpr int bf16_value_chunks() {
  return G * 4 + 4 + 5 <= 32 ? 4 : 2;
}

// Tokens per bf16 fold step on short ranges: four 16-token score blocks share one softmax update
// (its max and sum reductions and scalar exp) and one pass of loading, rescaling and storing the
// output accumulators. Measured on Zen 4 (one thread, thread CPU time, shared machine): 16
// requests x 130 tokens in cache 124 -> 102 us per layer, out of cache (30 layers) 280-298 ->
// 254-259 us. Ranges longer than kBf16ShortRange keep 16-token steps: there the step waits on
// memory, and 64-token steps (prefetching 64 rows at once) measured 8-12% slower out of cache
// (8 x 2048 tokens: 1.82-1.90 -> 2.00-2.17 ms per layer), though 1 x 2048 in cache was 17% faster.
constexpr int64_t kBf16StepTokens = 64;
constexpr int64_t kBf16ShortRange = 512;

// p[g * p_stride + j] = (scale q_g) . K[slots[j]] for j < n <= 16, 0 for j in [n, 16); qb: [G][D / 2]
// bf16 pairs.
template <int G>
inline void scores_bf16(const uint32_t* qb, const at::BFloat16* k_buf, int64_t row_stride, const int32_t* slots,
                        int n, int64_t D, float* p, int64_t p_stride) {
  const at::BFloat16* rows[kBlockTokens];
  for (int j = 0; j < n; ++j) rows[j] = k_buf + static_cast<int64_t>(slots[j]) * row_stride;
  for (int g = 0; g < G; ++g) {
    __m512 s[16];
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(qb + g * (D / 2) + d / 2);
      for (int j = 0; j < n; ++j) s[j] = _mm512_dpbf16_ps(s[j], qd, (__m512bh)_mm512_loadu_si512(rows[j] + d));
    }
    _mm512_store_ps(p + g * p_stride, reduce16x16(s));
  }
}

// softmax_update (attention_block.h) over n <= kBf16StepTokens scores p[0..n): one max, one sum,
// lanes past n (to the next multiple of 16) zeroed.
inline float softmax_update_wide(float* p, int n, float& m, float& l) {
  const int nv = (n + 15) / 16;
  auto valid = [n](int i) {
    const int left = n - 16 * i;
    return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  };
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < nv; ++i) mx = _mm512_mask_max_ps(mx, valid(i), mx, _mm512_load_ps(p + 16 * i));
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx));
  const float alpha = m_new == m ? 1.f : std::exp(m - m_new);  // most blocks of a long row keep m
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < nv; ++i) {
    const __m512 e =
        _mm512_maskz_mov_ps(valid(i), exp16_bf16_weights(_mm512_sub_ps(_mm512_load_ps(p + 16 * i), mv)));
    _mm512_store_ps(p + 16 * i, e);
    sum = _mm512_add_ps(sum, e);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

// vpermt2w indices interleaving two rows of 32 bf16 (a: 0-31, b: 32-63) into pairs: lane 2i of
// the first register is a[i], lane 2i + 1 b[i] (i < 16); the second register the same for i + 16.
alignas(64) inline constexpr int16_t kPairLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr int16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// fold_block for a bf16 pool by bf16 dot products, over n <= T tokens (T a multiple of 16; qb: this
// view's query, see scores_bf16).
template <int G, int kNB, int64_t T>
void fold_block_bf16(const HeadView<at::BFloat16>& v, const uint32_t* qb, int64_t D, const int32_t* slots, int n,
                     const HeadState& st) {
  static_assert(kNB % 2 == 0, "a permute of two rows gives two registers of pairs");
  alignas(64) float p[G][T];
  for (int j0 = 0; j0 < n; j0 += kBlockTokens)
    scores_bf16<G>(qb, v.k_buf, v.kv_row_stride, slots + j0, std::min<int>(kBlockTokens, n - j0), D, &p[0][j0], T);
  float alpha[G];
  alignas(64) uint32_t pw[G][T / 2];  // the weights of tokens 2i, 2i + 1 as a bf16 pair
  for (int g = 0; g < G; ++g) {
    alpha[g] = softmax_update_wide(p[g], n, st.m[g], st.l[g]);  // weights past n are 0
    for (int j0 = 0; j0 < n; j0 += kBlockTokens) {
      const __m256bh w = _mm512_cvtneps_pbh(_mm512_load_ps(p[g] + j0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g] + j0 / 2), (__m256i)w);
    }
  }
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  const int pairs = (n + 1) / 2;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * kNB) {
    __m512 o[G][kNB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c)
        o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + g * D + d0 + 16 * c), _mm512_set1_ps(alpha[g]));
    for (int i = 0; i < pairs; ++i) {
      const at::BFloat16* a = v.v_buf + static_cast<int64_t>(slots[2 * i]) * v.kv_row_stride + d0;
      const at::BFloat16* b =
          2 * i + 1 < n ? v.v_buf + static_cast<int64_t>(slots[2 * i + 1]) * v.kv_row_stride + d0 : nullptr;
      __m512bh vv[kNB];
      for (int c = 0; c < kNB; c += 2) {
        const __m512i ra = _mm512_loadu_si512(a + 16 * c);
        const __m512i rb = b ? _mm512_loadu_si512(b + 16 * c) : _mm512_setzero_si512();  // an odd n's last pair
        vv[c] = (__m512bh)_mm512_permutex2var_epi16(ra, lo, rb);
        vv[c + 1] = (__m512bh)_mm512_permutex2var_epi16(ra, hi, rb);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][i]));
        for (int c = 0; c < kNB; ++c) o[g][c] = _mm512_dpbf16_ps(o[g][c], w, vv[c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) _mm512_storeu_ps(st.acc + g * D + d0 + 16 * c, o[g][c]);
  }
}

// Blocks ahead that fold_range_bf16_steps prefetches into L2: a bf16 block is folded in fewer cycles than
// an fp32 one, so the fp32 step's 2 blocks are less time ahead of the loads. Measured on Zen 4
// (8 x 2048 tokens out of cache, one thread, shared machine): 2 blocks 1.74-1.80 ms per layer,
// 4 blocks 1.72-1.79, 8 blocks 1.66-1.76 (the fp32-step baseline 1.74-1.93 alongside).
constexpr int64_t kPrefetchBlocksBf16 = 8;

// The queries of n views (G heads each) times their softmax scale, rounded to bf16 pairs once:
// qstore [view][G][D / 2], what the bf16 score dots read (here and attention_short_bf16.h).
template <int G>
inline void round_queries_bf16(const HeadView<at::BFloat16>* views, int64_t n, int64_t D,
                               std::vector<uint32_t>& qstore) {
  const int64_t per_view = G * D / 2;
  qstore.resize(static_cast<size_t>(n * per_view));
  for (int64_t i = 0; i < n; ++i) {
    const __m512 sc = _mm512_set1_ps(views[i].scale);
    for (int g = 0; g < G; ++g) {
      const float* q = views[i].q + g * views[i].q_head_stride;
      uint32_t* dst = qstore.data() + i * per_view + g * (D / 2);
      for (int64_t d = 0; d < D; d += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + d), sc));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d / 2), (__m256i)h);
      }
    }
  }
}

// fold_range for a bf16 pool (decode_bf16_applies(D)): each view's query rounded to bf16 once, then
// the same block loop, prefetching and sharing of each block across sets.
template <int G, int kNB, int64_t kStep>
void fold_range_bf16_steps(const HeadView<at::BFloat16>* views, const HeadState* states, int64_t num_sets,
                     int64_t num_heads, int64_t D, const int32_t* slots, int64_t t0, int64_t t1) {
  thread_local std::vector<uint32_t> qstore;  // [set][head][G][D / 2] bf16 pairs of scale * q
  const int64_t views_n = num_sets * num_heads, per_view = G * D / 2;
  round_queries_bf16<G>(views, views_n, D, qstore);
  const int64_t row_bytes = num_heads * D * static_cast<int64_t>(sizeof(at::BFloat16));
  constexpr int64_t ahead = kPrefetchBlocksBf16 * kBlockTokens;
  for (int64_t tb = t0; tb < t1; tb += kStep) {
    const int n = static_cast<int>(std::min<int64_t>(kStep, t1 - tb));
    // The step's rows `ahead` tokens on, once for every head and set, before its folds. Issued
    // from inside the first fold instead (per 16 tokens), the same prefetches measured 20% slower
    // out of cache at 8 x 2048 tokens on Zen 4.
    const int64_t next = std::min<int64_t>(kStep, t1 - tb - ahead);
    if (next > 0) {
      prefetch_rows(views[0].k_buf, views[0].kv_row_stride, slots + tb + ahead, next, row_bytes);
      prefetch_rows(views[0].v_buf, views[0].kv_row_stride, slots + tb + ahead, next, row_bytes);
    }
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < num_sets; ++i) {
        const int64_t at = i * num_heads + h;
        fold_block_bf16<G, kNB, kStep>(views[at], qstore.data() + at * per_view, D, slots + tb, n, states[at]);
      }
  }
}

// fold_range for a bf16 pool: 64-token steps on short ranges, 16-token steps on long ones (see
// kBf16StepTokens).
template <int G, int kNB>
void fold_range_bf16(const HeadView<at::BFloat16>* views, const HeadState* states, int64_t num_sets,
                     int64_t num_heads, int64_t D, const int32_t* slots, int64_t t0, int64_t t1) {
  if (t1 - t0 <= kBf16ShortRange)
    return fold_range_bf16_steps<G, kNB, kBf16StepTokens>(views, states, num_sets, num_heads, D, slots, t0, t1);
  fold_range_bf16_steps<G, kNB, kBlockTokens>(views, states, num_sets, num_heads, D, slots, t0, t1);
}

#endif  // RS_HAVE_DECODE_BF16
