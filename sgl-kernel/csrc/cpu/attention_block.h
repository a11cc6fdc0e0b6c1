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

// Scores of one query row against a block of kBlockTokens keys, from the block's K transposed to
// kt [D][kBlockTokens]: out[j] = sum_d q[d] * kt[d][j]. Transposing once per block (shared by every
// query head and every request folded over it) makes each score a plain FMA chain: no horizontal
// sum per (token, head), which cost as much as the dot product itself.
#if RS_HAVE_AVX512
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

// kt [D][16] from the K rows slots[0..n) (rows n..15 read as zeros).
// k_scale: the int8 pool's per-row scales (offset to this KV head, stride scale_stride), or nullptr.
template <typename kv_t>
inline void transpose_keys(const kv_t* k_buf, int64_t row_stride, const float* k_scale, int64_t scale_stride,
                           const int32_t* slots, int n, int64_t D, float* kt) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) {
      r[j] = j < n ? load16(k_buf + static_cast<int64_t>(slots[j]) * row_stride + d0) : _mm512_setzero_ps();
      if (k_scale && j < n) r[j] = _mm512_mul_ps(r[j], _mm512_set1_ps(row_scale(k_scale, slots[j], scale_stride)));
    }
    transpose16x16(r);
    for (int x = 0; x < 16; ++x) _mm512_store_ps(kt + (d0 + x) * 16, r[x]);
  }
}

inline void score_row(const float* q, const float* kt, int64_t D, float scale, float* out) {
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t d = 0; d < D; d += 4)  // 4 independent chains (D is a multiple of 16)
    for (int i = 0; i < 4; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + i]), _mm512_load_ps(kt + (d + i) * 16), s[i]);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
  _mm512_store_ps(out, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
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

// Value chunks (of kWidth floats) per pass over a block: G * kNB accumulators + kNB rows + 1
// weight must fit the register file, and kNB must divide D / kWidth.
template <int G>
constexpr int max_value_chunks() {
  return (Vec::kRegisters - 1) / (G + 1) >= 4 ? 4 : (Vec::kRegisters - 1) / (G + 1) >= 2 ? 2 : 1;
}

// Folds K/V rows slots[0..n) into `st` for the G query heads of `v`; kt is the block's K
// transposed by transpose_keys.
template <int G, int kNB, typename kv_t>
void fold_block(const HeadView<kv_t>& v, int64_t D, const int32_t* slots, int n, const float* kt, const HeadState& st) {
  constexpr int64_t W = Vec::kWidth;
  alignas(64) float p[G][kBlockTokens];
  for (int g = 0; g < G; ++g) score_row(v.q + g * v.q_head_stride, kt, D, v.scale, p[g]);
  float alpha[G];
  for (int g = 0; g < G; ++g) {  // online softmax: what came before is rescaled by exp(m_old - m_new)
    float m_new = st.m[g];
    for (int j = 0; j < n; ++j) m_new = std::max(m_new, p[g][j]);
    alpha[g] = std::exp(st.m[g] - m_new);
    for (int j = n; j < kBlockTokens; ++j) p[g][j] = m_new;  // padding: exp(0), zeroed below
    for (int64_t j = 0; j < kBlockTokens; j += W) {
      Vec::store(&p[g][j], Vec::exp(Vec::sub(Vec::load(&p[g][j]), Vec::set1(m_new))));
    }
    float sum = 0.f;
    for (int j = 0; j < n; ++j) sum += p[g][j];
    for (int j = n; j < kBlockTokens; ++j) p[g][j] = 0.f;
    st.l[g] = st.l[g] * alpha[g] + sum;
    st.m[g] = m_new;
  }
  for (int64_t d0 = 0; d0 < D; d0 += W * kNB) {  // values
    typename Vec::reg o[G][kNB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) o[g][c] = Vec::mul(Vec::load(st.acc + g * D + d0 + W * c), Vec::set1(alpha[g]));
    for (int j = 0; j < n; ++j) {
      const kv_t* row = v.v_buf + static_cast<int64_t>(slots[j]) * v.kv_row_stride + d0;
      const float vs = row_scale(v.v_scale, slots[j], v.scale_stride);  // folded into the weight
      typename Vec::reg rows[kNB];
      for (int c = 0; c < kNB; ++c) rows[c] = Vec::load_kv(row + W * c);
      for (int g = 0; g < G; ++g) {
        const typename Vec::reg w = Vec::set1(p[g][j] * vs);
        for (int c = 0; c < kNB; ++c) o[g][c] = Vec::fma(w, rows[c], o[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) Vec::store(st.acc + g * D + d0 + W * c, o[g][c]);
  }
}

template <typename kv_t>
inline void prefetch_rows(const kv_t* buf, int64_t row_stride, const int32_t* slots, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    const char* p = reinterpret_cast<const char*>(buf + static_cast<int64_t>(slots[j]) * row_stride);
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(kv_t)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

// Tokens [t0, t1) of `slots`, shared by `num_heads_sets` query-head sets (the requests of a
// shared prefix, or one request): each block of K/V rows is read from memory once and folded into
// every set's state while it sits in L1; the next block is prefetched (the slot indirection
// defeats the hardware prefetcher).
template <int G, int kNB, typename kv_t>
void fold_range(const HeadView<kv_t>* views, const HeadState* states, int64_t num_heads_sets, int64_t D,
                const int32_t* slots, int64_t t0, int64_t t1) {
  alignas(64) thread_local float kt[kMaxHeadDim * kBlockTokens];  // [D][kBlockTokens]
  for (int64_t tb = t0; tb < t1; tb += kBlockTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockTokens, t1 - tb));
    const int64_t next = std::min<int64_t>(kBlockTokens, t1 - tb - kBlockTokens);
    if (next > 0) {
      prefetch_rows(views[0].k_buf, views[0].kv_row_stride, slots + tb + kBlockTokens, next, D);
      prefetch_rows(views[0].v_buf, views[0].kv_row_stride, slots + tb + kBlockTokens, next, D);
    }
    transpose_keys(views[0].k_buf, views[0].kv_row_stride, views[0].k_scale, views[0].scale_stride, slots + tb, n, D,
                   kt);
    for (int64_t i = 0; i < num_heads_sets; ++i) fold_block<G, kNB>(views[i], D, slots + tb, n, kt, states[i]);
  }
}

#endif  // RS_HAVE_AVX2
