// The inner step of the CPU decode attention: one block of up to kBlockTokens K/V rows folded
// into the online-softmax state of G query heads (flash-decoding), on AVX-512 or AVX2.
#pragma once

#include "common.h"


#if RS_HAVE_AVX2

constexpr int64_t kBlockTokens = 16;

constexpr int64_t kMaxHeadDim = 256;  // the transposed key block lives in a fixed TLS buffer

// The few vector operations the block needs, on the widest registers the build has.
#if RS_HAVE_AVX512
struct Vec {
  using reg = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr int kRegisters = 32;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static reg load_kv(const T* p) { return load16(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg exp(reg x) { return exp16(x); }
  static float sum(reg x) { return _mm512_reduce_add_ps(x); }
};
#else
struct Vec {
  using reg = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int kRegisters = 16;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static reg load_kv(const T* p) { return load8(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg exp(reg x) { return exp8(x); }
  static float sum(reg x) { return hsum(x); }
};
#endif

// Scores of G query rows against a block of kBlockTokens keys.
#if RS_HAVE_AVX512
// AVX-512: the block's K rows are widened to fp32 once (kb [kBlockTokens][D], shared by every
// query head and every request folded over the block), each score is a chain of D / 16 FMAs, and
// the 16 tokens' partial-sum vectors are reduced together by a tree of shuffles (45 operations
// per query row and block), far cheaper than transposing the block (a 16x16 transpose per 16 of
// D, 3x the FMAs' cost at head_dim 64, measured on Zen 4) or a horizontal sum per token.
// A 16x16 transpose in registers (extend_attention_tile.h transposes its key tiles with it).
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 * i + k]: rows 4i..4i+3 at column 4L + k of each 128-bit lane L.
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 v2 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD), v3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(v2, v3, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(v2, v3, 0xDD);
  }
}

// kb [num_heads][kBlockTokens][D] from the K rows slots[0..n) of num_heads consecutive KV heads
// (rows n..15 zero), each row read front to back; k_scale: the int8 pool's per-row scales (offset
// to the first of these KV heads, stride scale_stride), folded into the rows, or nullptr.
template <typename kv_t>
inline void prepare_keys(const kv_t* k_buf, int64_t row_stride, const float* k_scale, int64_t scale_stride,
                         const int32_t* slots, int n, int64_t num_heads, int64_t D, float* kb) {
  for (int j = 0; j < kBlockTokens; ++j) {
    const kv_t* src = j < n ? k_buf + static_cast<int64_t>(slots[j]) * row_stride : nullptr;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* dst = kb + (h * kBlockTokens + j) * D;
      if (src == nullptr) {
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(dst + d, _mm512_setzero_ps());
        continue;
      }
      const __m512 ks = _mm512_set1_ps(row_scale(k_scale ? k_scale + h : nullptr, slots[j], scale_stride));
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = load16(src + h * D + d);
        _mm512_store_ps(dst + d, k_scale ? _mm512_mul_ps(x, ks) : x);
      }
    }
  }
}

// Lane j of the result: the sum of the 16 lanes of s[j].
inline __m512 reduce16x16(__m512 s[16]) {
  __m512 x[8], y[4], z[2];
  // x[i], per 128-bit lane: (s[2i], s[2i+1], s[2i], s[2i+1]) partials.
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  // y[i], per 128-bit lane: tokens 4i..4i+3, one partial each.
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  // z[i]: y[2i]'s lanes (0+2, 1+3), then y[2i+1]'s.
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// out[j] = scale * q . kb[j] for j < kBlockTokens (D a multiple of 16).
inline void score_row(const float* q, const float* kb, int64_t D, float scale, float* out) {
  __m512 s[16];
  for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {  // 16 independent FMA chains
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(qd, _mm512_load_ps(kb + j * D + d), s[j]);
  }
  _mm512_store_ps(out, _mm512_mul_ps(reduce16x16(s), _mm512_set1_ps(scale)));
}
#else
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // u[k] (rows 0-3) and u[4 + k] (rows 4-7) hold column k in their low lane, column 4 + k high.
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// AVX2 (16 registers: no room for 16 partial sums): the block's K transposed to kt [D][16], so each
// score is a plain FMA chain over D; the transpose is shared by every query head and request.
template <typename kv_t>
inline void transpose_keys(const kv_t* k_buf, int64_t row_stride, const float* k_scale, int64_t scale_stride,
                           const int32_t* slots, int n, int64_t D, float* kt) {
  for (int half = 0; half < 2; ++half) {  // tokens 0-7, then 8-15
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) {
        const int t = 8 * half + j;
        r[j] = t < n ? load8(k_buf + static_cast<int64_t>(slots[t]) * row_stride + d0) : _mm256_setzero_ps();
        if (k_scale && t < n) r[j] = _mm256_mul_ps(r[j], _mm256_set1_ps(row_scale(k_scale, slots[t], scale_stride)));
      }
      transpose8x8(r);
      for (int x = 0; x < 8; ++x) _mm256_store_ps(kt + (d0 + x) * 16 + 8 * half, r[x]);
    }
  }
}

// kt [num_heads][D][16]: transpose_keys for each of num_heads consecutive KV heads.
template <typename kv_t>
inline void prepare_keys(const kv_t* k_buf, int64_t row_stride, const float* k_scale, int64_t scale_stride,
                         const int32_t* slots, int n, int64_t num_heads, int64_t D, float* kt) {
  for (int64_t h = 0; h < num_heads; ++h)
    transpose_keys(k_buf + h * D, row_stride, k_scale ? k_scale + h : nullptr, scale_stride, slots, n, D,
                   kt + h * D * kBlockTokens);
}

inline void score_row(const float* q, const float* kt, int64_t D, float scale, float* out) {
  __m256 lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, hi[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t d = 0; d < D; d += 2) {  // D is a multiple of 8
    for (int i = 0; i < 2; ++i) {
      const __m256 qd = _mm256_set1_ps(q[d + i]);
      lo[i] = _mm256_fmadd_ps(qd, _mm256_load_ps(kt + (d + i) * 16), lo[i]);
      hi[i] = _mm256_fmadd_ps(qd, _mm256_load_ps(kt + (d + i) * 16 + 8), hi[i]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  _mm256_store_ps(out, _mm256_mul_ps(_mm256_add_ps(lo[0], lo[1]), sc));
  _mm256_store_ps(out + 8, _mm256_mul_ps(_mm256_add_ps(hi[0], hi[1]), sc));
}
#endif

// One (request, KV head) as the block kernel sees it.
template <typename kv_t>
struct HeadView {
  const float* q;  // [G, D], row stride q_head_stride
  int64_t q_head_stride;
  const kv_t* k_buf;  // the pool [N, Hkv, D], offset to this KV head
  const kv_t* v_buf;
  int64_t kv_row_stride;  // Hkv * D
  float scale;
  const float* k_scale = nullptr;  // int8 pools: per-(slot, KV head) scales offset to this head
  const float* v_scale = nullptr;
  int64_t scale_stride = 0;  // Hkv
};

// Online-softmax state of G query heads: acc [G, D] (un-normalized output), m [G] (running max of
// the scores), l [G] (running sum of exp(score - m)).
struct HeadState {
  float* acc;
  float* m;
  float* l;
};

inline void reset_state(const HeadState& s, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) s.m[g] = -std::numeric_limits<float>::infinity(), s.l[g] = 0.f;
  std::memset(s.acc, 0, sizeof(float) * G * D);
}

// acc /= l: the finished output of a state that holds all of its request's tokens (l > 0: at
// least one token was folded, and the largest score's weight is 1).
inline void normalize_state(const HeadState& s, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    const Vec::reg inv = Vec::set1(1.f / s.l[g]);
    float* acc = s.acc + g * D;
    for (int64_t d = 0; d < D; d += Vec::kWidth) Vec::store(acc + d, Vec::mul(Vec::load(acc + d), inv));
  }
}

// Value chunks (of kWidth floats) per pass over a block: G * kNB accumulators + kNB rows + 1
// weight must fit the register file, and kNB must divide D / kWidth.
template <int G>
constexpr int max_value_chunks() {
  return (Vec::kRegisters - 1) / (G + 1) >= 4 ? 4 : (Vec::kRegisters - 1) / (G + 1) >= 2 ? 2 : 1;
}

// The online-softmax step of one query row over a block: p [kBlockTokens] holds its scores (lanes
// n.. are padding); on return p[j] = exp(p[j] - m_new) (0 for the padding), l = l * alpha + sum p,
// m = m_new = max(m, scores); returns alpha = exp(m_old - m_new), what came before is rescaled by.
#if RS_HAVE_AVX512
inline float softmax_update(float* p, int n, float& m, float& l) {
  const __mmask16 valid = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 s = _mm512_load_ps(p);
  const float m_new = std::max(m, _mm512_mask_reduce_max_ps(valid, s));
  const float alpha = std::exp(m - m_new);
  const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  _mm512_store_ps(p, e);
  l = l * alpha + _mm512_reduce_add_ps(e);
  m = m_new;
  return alpha;
}
#else
inline float softmax_update(float* p, int n, float& m, float& l) {
  float m_new = m;
  for (int j = 0; j < n; ++j) m_new = std::max(m_new, p[j]);
  const float alpha = std::exp(m - m_new);
  for (int j = n; j < kBlockTokens; ++j) p[j] = m_new;  // padding: exp(0), zeroed below
  for (int64_t j = 0; j < kBlockTokens; j += Vec::kWidth) {
    Vec::store(p + j, Vec::exp(Vec::sub(Vec::load(p + j), Vec::set1(m_new))));
  }
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += p[j];
  for (int j = n; j < kBlockTokens; ++j) p[j] = 0.f;
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}
#endif

// Folds K/V rows slots[0..n) into `st` for the G query heads of `v`; keys: the block's K as
// prepare_keys left it.
template <int G, int kNB, typename kv_t>
void fold_block(const HeadView<kv_t>& v, int64_t D, const int32_t* slots, int n, const float* keys,
                const HeadState& st) {
  constexpr int64_t W = Vec::kWidth;
  alignas(64) float p[G][kBlockTokens];
  for (int g = 0; g < G; ++g) score_row(v.q + g * v.q_head_stride, keys, D, v.scale, p[g]);
  float alpha[G];
  for (int g = 0; g < G; ++g) alpha[g] = softmax_update(p[g], n, st.m[g], st.l[g]);
  if (v.v_scale) {  // int8 V: each row's scale folded into its weights (after the sum l)
    alignas(64) float vs[kBlockTokens];
    for (int j = 0; j < n; ++j) vs[j] = row_scale(v.v_scale, slots[j], v.scale_stride);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < n; ++j) p[g][j] *= vs[j];
  }
  for (int64_t d0 = 0; d0 < D; d0 += W * kNB) {  // values
    typename Vec::reg o[G][kNB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) o[g][c] = Vec::mul(Vec::load(st.acc + g * D + d0 + W * c), Vec::set1(alpha[g]));
    for (int j = 0; j < n; ++j) {
      const kv_t* row = v.v_buf + static_cast<int64_t>(slots[j]) * v.kv_row_stride + d0;
      typename Vec::reg rows[kNB];
      for (int c = 0; c < kNB; ++c) rows[c] = Vec::load_kv(row + W * c);
      for (int g = 0; g < G; ++g) {
        const typename Vec::reg w = Vec::set1(p[g][j]);
        for (int c = 0; c < kNB; ++c) o[g][c] = Vec::fma(w, rows[c], o[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) Vec::store(st.acc + g * D + d0 + W * c, o[g][c]);
  }
}

// Prefetches `bytes` from the start of each of the rows slots[0..n).
template <typename kv_t>
inline void prefetch_rows(const kv_t* buf, int64_t row_stride, const int32_t* slots, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* p = reinterpret_cast<const char*>(buf + static_cast<int64_t>(slots[j]) * row_stride);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// Blocks ahead that fold_range prefetches: into L2, two blocks ahead (measured on Zen 4: into L1
// one block ahead, the prefetches filled the core's miss buffers and stalled it).
constexpr int64_t kPrefetchBlocks = 2;

// Tokens [t0, t1) of `slots` for `num_heads` consecutive KV heads, shared by `num_sets` query-head
// sets (the requests of a shared prefix, or one request); views and states are [set][head]. Each
// block of K/V rows is read from memory once and folded into every set's state while it sits in
// cache. A task that takes every KV head reads each token's K and V row whole and front to back,
// where a task per head read a third of each row at a stride; the rows two blocks ahead are
// prefetched, since the slot indirection defeats the hardware prefetcher when slots are scattered.
template <int G, int kNB, typename kv_t>
void fold_range(const HeadView<kv_t>* views, const HeadState* states, int64_t num_sets, int64_t num_heads, int64_t D,
                const int32_t* slots, int64_t t0, int64_t t1) {
  thread_local std::vector<float> key_storage;  // the block's keys as prepare_keys leaves them, 64-byte aligned
  key_storage.resize(static_cast<size_t>(num_heads * D * kBlockTokens + 16));
  float* keys = key_storage.data() + ((64 - reinterpret_cast<uintptr_t>(key_storage.data()) % 64) % 64) / sizeof(float);
  const int64_t row_bytes = num_heads * D * static_cast<int64_t>(sizeof(kv_t));  // heads are contiguous in a row
  constexpr int64_t ahead = kPrefetchBlocks * kBlockTokens;
  for (int64_t tb = t0; tb < t1; tb += kBlockTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockTokens, t1 - tb));
    const int64_t next = std::min<int64_t>(kBlockTokens, t1 - tb - ahead);
    if (next > 0) {
      prefetch_rows(views[0].k_buf, views[0].kv_row_stride, slots + tb + ahead, next, row_bytes);
      prefetch_rows(views[0].v_buf, views[0].kv_row_stride, slots + tb + ahead, next, row_bytes);
    }
    prepare_keys(views[0].k_buf, views[0].kv_row_stride, views[0].k_scale, views[0].scale_stride, slots + tb, n,
                 num_heads, D, keys);
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < num_sets; ++i)
        fold_block<G, kNB>(views[i * num_heads + h], D, slots + tb, n, keys + h * D * kBlockTokens,
                           states[i * num_heads + h]);
  }
}

#endif  // RS_HAVE_AVX2
