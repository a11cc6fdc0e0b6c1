// Small vector helpers shared by the CPU kernels. Compiled with -O3 and OpenMP SIMD so the
// loops below become AVX2/FMA code on this machine (built at `make setup`, -march=native).
#pragma once

// ATen only (not torch/extension.h): the kernels compile much faster without pybind/autograd.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"  // rs::parallel_for: the step team inside a decode step

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_HAVE_AVX2 1
#else
#define RS_HAVE_AVX2 0
#endif

// AVX-512 paths are compiled when the build machine has it (-march=native); AVX2 machines use
// the AVX2 paths of the same kernels.
#if RS_HAVE_AVX2 && defined(__AVX512F__)
#define RS_HAVE_AVX512 1
#else
#define RS_HAVE_AVX512 0
#endif

// The code paths a kernel can be forced onto (its *_isas() list for tests and benchmarks).
inline std::vector<std::string> isa_names(bool avx2, bool avx512) {
  std::vector<std::string> isas{"scalar"};
  if (avx2) isas.emplace_back("avx2");
  if (avx512) isas.emplace_back("avx512");
  return isas;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e5m2 x) { return static_cast<float>(x); }

// The KV pool's per-(slot, KV head) dequantization scale: int8 pools carry one ([N, Hkv] fp32),
// the others none (nullptr: the stored value is the value).
inline float row_scale(const float* scales, int32_t slot, int64_t stride) {
  return scales ? scales[static_cast<int64_t>(slot) * stride] : 1.f;
}

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

template <typename T>
inline void axpy(float* __restrict y, float alpha, const T* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * to_float(x[i]);
}

// Calls f(kv_t{}) with the element type of a KV pool the attention kernels read.
template <typename F>
void dispatch_kv_dtype(at::ScalarType dtype, const char* name, const F& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kFloat8_e4m3fn: return f(at::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return f(at::Float8_e5m2{});
    case at::kChar: return f(int8_t{});
    default:
      TORCH_CHECK_VALUE(false, name, ": K/V must be float32, bfloat16, float8_e4m3fn, float8_e5m2 or int8, got ",
                        dtype);
  }
}

// An int8 pool's scales (k_scale, v_scale: contiguous fp32 [N, Hkv], value = int8 * scale), which
// int8 K/V require and other dtypes refuse; nullptrs for the others.
inline std::pair<const float*, const float*> kv_scales(const char* name, const at::Tensor& k_buf,
                                                       const c10::optional<at::Tensor>& k_scale,
                                                       const c10::optional<at::Tensor>& v_scale) {
  const bool is_int8 = k_buf.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(k_scale.has_value() == is_int8 && v_scale.has_value() == is_int8, name,
                    ": int8 K/V need k_scale and v_scale (float32 [N, Hkv]); other dtypes take none");
  if (!is_int8) return {nullptr, nullptr};
  for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
    TORCH_CHECK_VALUE(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 2 &&
                          s->size(0) == k_buf.size(0) && s->size(1) == k_buf.size(1),
                      name, ": k_scale and v_scale must be contiguous float32 [N, Hkv] matching the K/V pool");
  }
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

#if RS_HAVE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// bf16 is the top half of an fp32: widen to 32 bits and shift into place.
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// fp8 e5m2 is the top byte of an fp16: widen each byte into the high half of a 16-bit lane.
inline __m256 load8(const at::Float8_e5m2* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}

// fp8 e4m3fn: its 4 exponent and 3 mantissa bits placed in an fp16's exponent and mantissa give
// the value times 2^-8 (exponent bias 7 vs 15), subnormals included; one multiply restores it.
// The pool never stores e4m3's NaN (writes saturate at +-448).
inline __m256 fp8_e4m3_to_f32(__m128i w) {  // w: 8 bytes widened to 16-bit lanes
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.f));
}

inline __m256 load8(const at::Float8_e4m3fn* p) {
  return fp8_e4m3_to_f32(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if RS_HAVE_AVX2
// exp(x) for 8 floats: x = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, then
// scaled by 2^n through the exponent bits. Relative error ~2e-7 over the clamped range; inputs
// below -87.3 give ~1e-38 rather than 0, which no softmax or sigmoid here can tell apart.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in two so that n*ln2_hi is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// In place: x = softmax(x). Assumes n >= 1.
inline void softmax_inplace(float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0.f;
  int64_t i = 0;
#if RS_HAVE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

#if RS_HAVE_AVX512
// exp8's algorithm on 16 floats.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp(x) for x <= 0 to a relative error below 5e-5, for softmax weights that are rounded to bf16
// next (relative 2^-9 = 2e-3): exp16's range reduction with one ln 2 term, a degree-4 Taylor
// polynomial on |r| <= ln 2 / 2 (error r^5 / 120 <= 4.2e-5) and scalef for the 2^n, 9 vector
// operations against exp16's 17. Why: in the bf16 attention steps the softmax's exps are a quarter of
// the vector work beside the vdpbf16ps products. Inputs below -87.3 (and -inf) give ~1e-38 as exp16.
inline __m512 exp16_bf16_weights(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.f / 24), r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 join16(__m256 lo, __m256 hi) {  // AVX-512F only (no DQ)
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

// The 8-lane fp8 conversions above, twice: they need no AVX-512BW.
inline __m512 load16(const at::Float8_e5m2* p) {
  return join16(load8(p), load8(p + 8));
}

inline __m512 load16(const at::Float8_e4m3fn* p) {
  return join16(load8(p), load8(p + 8));
}
#endif
