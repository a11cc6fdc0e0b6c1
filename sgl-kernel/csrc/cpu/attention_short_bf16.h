// The decode attention of one short request on a bf16 pool with AVX512_BF16: every score first,
// one softmax per query head, then the values, instead of the online-softmax block steps.
//
// Why: a batch of 16-64 requests of 128-512 tokens is compute-bound per (request, layer) on the
// block step's fixed costs: its 16-token score loop with a branch per token, the softmax's
// reductions and scalar exp per step, the output accumulators loaded, rescaled and stored per step.
// With the whole context's scores in a small buffer (G x 512 fp32 per KV head, in L1/L2):
// - scores: 16 tokens at a time, padded to 16 by repeating the last slot (no branch per token),
//   each K row read as bf16 pairs against q * scale rounded to bf16 (vdpbf16ps), 16 partial-sum
//   vectors reduced together (reduce16x16);
// - one max, one exp pass and one sum per query head, vectorized over tokens; the weights rounded
//   to bf16 pairs (no running max, so no rescale of the accumulators);
// - values: per KV head, G x kNB accumulators in registers over the whole context, two V rows
//   interleaved into pairs (vpermt2w) for one vdpbf16ps per query head and 16 outputs, stored
//   once into the output rows, times 1 / sum.
// The next request's K and V rows are prefetched into L2 while this one is computed (a batch's
// rows are scattered in a pool far larger than the caches).
// Numerics as attention_block_bf16.h: K, V exact; q * scale and the weights rounded to bf16;
// products, sums and the softmax fp32.
#pragma once

#include "attention_block_bf16.h"

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <vector>

#if RS_HAVE_DECODE_BF16

// Longest context the whole-request path takes: scores of 8 query heads x 512 tokens are 16 KB
// per KV head; longer requests keep the block steps (and their splits across threads).
constexpr int64_t kShortMaxTokens = 512;

// The first 64-byte boundary at or after p (a vector with 64 spare bytes).
template <typename T>
inline T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Prefetch steps a 16-token score block (per KV head) counts for against one value pair: the
// next request's lines are spread over score blocks and value pairs in this ratio. Measured on
// Zen 4 (64 x 128 tokens out of cache, one thread, shared machine, ms per layer): 1: 0.65-0.83,
// 4: 0.56-0.69, 8: 0.55-0.66, 16: 0.49-0.57, 32: 0.46-0.75, 64: 0.63-0.77, every line during
// the first score blocks: 0.79-0.94 (bursts stall on the miss buffers). Hints: T1 (L2) and T2
// alike, T0 (L1) 0.65-1.17.
constexpr int64_t kScoreBlockSteps = 16;

// Prefetches into L2, a few cache lines at a time, the K and V rows of a request that is folded
// next, so that its rows arrive while this one computes. Spread evenly over the work (every score
// block, every value pair): bursts of whole slices of rows filled the core's miss buffers and
// stalled the compute beside them (measured on Zen 4, 64 x 128 tokens: 0.72 -> 0.49-0.61 ms).
struct NextRowsPrefetch {
  const char* k = nullptr;  // the pools at the first KV head a task reads
  const char* v = nullptr;
  std::vector<int64_t>* lines = nullptr;  // byte offsets of the rows' cache lines
  int64_t at = 0, end = 0;  // the next line, the number of lines
  int64_t per_step = 0;  // lines of K and of V per step()

  // Lines [0, bytes) of each row slots[0..count) (row stride row_stride_bytes).
  void set(const char* k_pool, const char* v_pool, int64_t row_stride_bytes, int64_t bytes, const int32_t* slots,
           int64_t count, std::vector<int64_t>& storage) {
    k = k_pool, v = v_pool, lines = &storage;
    const int64_t per_row = (bytes + 63) / 64;
    storage.resize(static_cast<size_t>(count * per_row));
    int64_t* out = storage.data();
    for (int64_t t = 0; t < count; ++t) {
      const int64_t row = static_cast<int64_t>(slots[t]) * row_stride_bytes;
      for (int64_t i = 0; i < per_row; ++i) *out++ = row + 64 * i;
    }
    at = 0, end = count * per_row;
  }

  // Spreads the lines over `steps` calls of step().
  void plan(int64_t steps) { per_step = (end + steps - 1) / std::max<int64_t>(steps, 1); }

  void step() {
    for (const int64_t stop = std::min(end, at + per_step); at < stop; ++at) {
      _mm_prefetch(k + (*lines)[at], _MM_HINT_T1);
      _mm_prefetch(v + (*lines)[at], _MM_HINT_T1);
    }
  }
};

// p[g * p_stride + j] = (scale q_g) . K[rows[j]] for 16 tokens; qb: [G][D / 2] bf16 pairs.
template <int G>
inline void scores16_bf16(const uint32_t* qb, const at::BFloat16* k, const int64_t* offsets, int64_t D, float* p,
                          int64_t p_stride) {
  for (int g = 0; g < G; ++g) {
    __m512 s[16];
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(qb + g * (D / 2) + d / 2);
      for (int j = 0; j < 16; ++j) s[j] = _mm512_dpbf16_ps(s[j], qd, (__m512bh)_mm512_loadu_si512(k + offsets[j] + d));
    }
    _mm512_store_ps(p + g * p_stride, reduce16x16(s));
  }
}

// Scores s[0..len) (the buffer padded to a multiple of 32) -> pw[0..lpad / 2): the softmax weights
// exp(s - max) of tokens 2i, 2i + 1 as a bf16 pair, 0 past len; returns 1 / their sum. The sum
// divides the outputs, not the weights: the largest weights (1) then round exactly, and
// normalized weights measured ~10% more error against fp32 attention.
inline float softmax_weights_bf16(float* s, int64_t len, int64_t lpad, uint32_t* pw) {
  auto valid = [len](int64_t i) {
    const int64_t left = len - i;
    return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                      : left <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << left) - 1);
  };
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < len; i += 16) mx = _mm512_mask_max_ps(mx, valid(i), mx, _mm512_load_ps(s + i));
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < lpad; i += 16) {
    const __m512 e = _mm512_maskz_mov_ps(valid(i), exp16_bf16_weights(_mm512_sub_ps(_mm512_load_ps(s + i), mv)));
    _mm512_store_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  for (int64_t i = 0; i < lpad; i += 32) {
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(s + i + 16), _mm512_load_ps(s + i));
    _mm512_store_si512(pw + i / 2, (__m512i)w);
  }
  return 1.f / _mm512_reduce_add_ps(sum);  // the largest weight is 1: sum >= 1
}

// out_g[d0, d0 + 16 kNB) = inv_g sum_i pw_g[i] . (V[2i], V[2i + 1]) over `pairs` pairs for the G
// query heads of one KV head; offsets: element offsets of the rows (padded to an even count).
template <int G, int kNB>
inline void values_bf16(const at::BFloat16* v, const int64_t* offsets, int64_t pairs, const uint32_t* pw,
                        int64_t pw_stride, const float* inv, float* out, int64_t out_stride,
                        NextRowsPrefetch& next) {
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  // The prefetch cursor in locals: with `next` written inside the loop GCC kept the accumulators
  // in memory.
  const char *pk = next.k, *pv = next.v;
  const int64_t* lines = next.lines ? next.lines->data() : nullptr;
  int64_t at = next.at;
  const int64_t end = next.end, per_pair = next.per_step;
  __m512 o[G][kNB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kNB; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    for (const int64_t stop = std::min(end, at + per_pair); at < stop; ++at) {
      _mm_prefetch(pk + lines[at], _MM_HINT_T1);
      _mm_prefetch(pv + lines[at], _MM_HINT_T1);
    }
    const at::BFloat16* a = v + offsets[2 * i];
    const at::BFloat16* b = v + offsets[2 * i + 1];
    __m512bh vv[kNB];
    for (int c = 0; c < kNB; c += 2) {
      const __m512i ra = _mm512_loadu_si512(a + 16 * c), rb = _mm512_loadu_si512(b + 16 * c);
      vv[c] = (__m512bh)_mm512_permutex2var_epi16(ra, lo, rb);
      vv[c + 1] = (__m512bh)_mm512_permutex2var_epi16(ra, hi, rb);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g * pw_stride + i]));
      for (int c = 0; c < kNB; ++c) o[g][c] = _mm512_dpbf16_ps(o[g][c], w, vv[c]);
    }
  }
  next.at = at;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kNB; ++c) _mm512_storeu_ps(out + g * out_stride + 16 * c, _mm512_mul_ps(o[g][c], _mm512_set1_ps(inv[g])));
}

// The attention of one request of len <= kShortMaxTokens tokens for num_heads KV heads: views[h]
// (each view's k_buf / v_buf offset to its KV head) into outs[h] ([G, D], row stride out_stride),
// normalized. `next`: the rows to prefetch meanwhile (count 0: none).
template <int G, int kNB>
void fold_request_bf16(const HeadView<at::BFloat16>* views, int64_t num_heads, int64_t D, const int32_t* slots,
                       int64_t len, float* const* outs, int64_t out_stride, NextRowsPrefetch& next) {
  const int64_t lpad = (len + 31) / 32 * 32, blocks = (len + 15) / 16;
  thread_local std::vector<int64_t> offsets;  // element offsets of the rows, the last repeated to lpad
  thread_local std::vector<uint32_t> qstore;  // [head][G][D / 2] bf16 pairs of scale * q
  thread_local std::vector<float> scores_store;  // [head][G][lpad], 64-byte aligned
  thread_local std::vector<uint32_t> pw_store;  // [head][G][lpad / 2], 64-byte aligned
  offsets.resize(static_cast<size_t>(lpad));
  const int64_t row_stride = views[0].kv_row_stride;
  for (int64_t t = 0; t < lpad; ++t) offsets[t] = static_cast<int64_t>(slots[std::min(t, len - 1)]) * row_stride;
  const int64_t per_view = G * D / 2;
  round_queries_bf16<G>(views, num_heads, D, qstore);
  scores_store.resize(static_cast<size_t>(num_heads * G * lpad + 16));
  pw_store.resize(static_cast<size_t>(num_heads * G * lpad / 2 + 16));
  float* scores = align64(scores_store.data());
  uint32_t* pw = align64(pw_store.data());
  const int64_t pairs = (len + 1) / 2;
  const int64_t chunks = D / (16 * kNB);
  // The next request's rows spread over every score block and every value pair.
  next.plan(num_heads * (kScoreBlockSteps * blocks + chunks * pairs));
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t h = 0; h < num_heads; ++h) {
      scores16_bf16<G>(qstore.data() + h * per_view, views[h].k_buf, offsets.data() + 16 * b, D,
                       scores + h * G * lpad + 16 * b, lpad);
      for (int64_t i = 0; i < kScoreBlockSteps; ++i) next.step();
    }
  }
  thread_local std::vector<float> inv;  // [head][G]: 1 / the softmax sums
  inv.resize(static_cast<size_t>(num_heads * G));
  for (int64_t r = 0; r < num_heads * G; ++r)
    inv[r] = softmax_weights_bf16(scores + r * lpad, len, lpad, pw + r * lpad / 2);
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d0 = 0; d0 < D; d0 += 16 * kNB)
      values_bf16<G, kNB>(views[h].v_buf + d0, offsets.data(), pairs, pw + h * G * lpad / 2, lpad / 2,
                          inv.data() + h * G, outs[h] + d0, out_stride, next);
}

// fold_request_bf16 with its value chunk count for G and D (decode_bf16_applies(D)).
template <int G>
void fold_request_bf16_g(const HeadView<at::BFloat16>* views, int64_t num_heads, int64_t D, const int32_t* slots,
                         int64_t len, float* const* outs, int64_t out_stride, NextRowsPrefetch& next) {
  if constexpr (bf16_value_chunks<G>() == 4) {
    if (D % 64 == 0) return fold_request_bf16<G, 4>(views, num_heads, D, slots, len, outs, out_stride, next);
  }
  fold_request_bf16<G, 2>(views, num_heads, D, slots, len, outs, out_stride, next);
}

// fold_request_bf16 for G query heads per KV head (1 to 8).
inline bool fold_request_dispatch(const HeadView<at::BFloat16>* views, int64_t nh, int64_t G, int64_t D,
                                  const int32_t* slots, int64_t len, float* const* outs, int64_t out_stride,
                                  NextRowsPrefetch& next) {
  switch (G) {
    case 1: fold_request_bf16_g<1>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 2: fold_request_bf16_g<2>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 3: fold_request_bf16_g<3>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 4: fold_request_bf16_g<4>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 5: fold_request_bf16_g<5>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 6: fold_request_bf16_g<6>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 7: fold_request_bf16_g<7>(views, nh, D, slots, len, outs, out_stride, next); return true;
    case 8: fold_request_bf16_g<8>(views, nh, D, slots, len, outs, out_stride, next); return true;
    default: return false;
  }
}

// RADIXSERVE_DECODE_ATTENTION_BLOCKS=1 keeps short requests on the block steps (A/B and tests);
// read per call (one getenv against a call's tens of microseconds).
inline bool short_path_enabled() {
  const char* v = std::getenv("RADIXSERVE_DECODE_ATTENTION_BLOCKS");
  return v == nullptr || v[0] == '\0' || (v[0] == '0' && v[1] == '\0');
}

constexpr int64_t kShortTokens = kShortMaxTokens;
#else
constexpr int64_t kShortTokens = 0;  // no whole-request path in this build
#endif  // RS_HAVE_DECODE_BF16

// Whether a kv_t pool of head_dim D takes the whole-request path for its short requests.
template <typename kv_t>
bool short_path_applies([[maybe_unused]] int64_t D) {
#if RS_HAVE_DECODE_BF16
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) return decode_bf16_applies(D) && short_path_enabled();
#endif
  return false;
}
