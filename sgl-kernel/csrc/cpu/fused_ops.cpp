// The decoder layer's elementwise ops, fused: RMSNorm (optionally adding the residual first),
// neox rotary in place on q and k, SiLU-and-mul, and the K/V store into the token pool.
//
// Why: at small batches a decode step is ~30 layers x ~40 tiny torch ops, each paying Python and
// dispatcher overhead worth more than its arithmetic (a 576-float RMSNorm is 7 ops). Each of these
// is one call here, and the inputs are read once. Rows are split over threads only when there are
// enough of them to pay for the fork (at::parallel_for runs inline below the grain size).
#include "common.h"
#include "ops.h"

#include <type_traits>

namespace {

// Elements per parallel task: below this (every decode batch, small prefills) one thread runs the
// op. These ops are a few microseconds of work, and a parallel region entered right after a
// oneDNN GEMM cost ~40 us to start (measured: at batch 64 the norms took 2.8 ms per step
// threaded vs 0.5 ms inline).
constexpr int64_t kGrainElems = 1 << 22;

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

inline float sum_squares(const float* __restrict x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline void scale_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                      float eps) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}


// out[i] = silu(gate[i]) * up[i]
void silu_mul_row(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
#if RS_HAVE_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// x[h, :half], x[h, half:] <- (x1*c - x2*s, x2*c + x1*s) for every head of one token.
void rotate_heads(float* x, int64_t num_heads, int64_t head_stride, const float* __restrict c,
                  const float* __restrict s, int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* __restrict x1 = x + h * head_stride;
    float* __restrict x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              ": expected a float32 [rows, n] tensor with contiguous rows");
}

}  // namespace

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rmsnorm");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1),
              "rmsnorm: weight must be a contiguous float32 [n]");
  const int64_t M = x.size(0), N = x.size(1), ldx = x.stride(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rs::parallel_for(0, M, grain_rows(N), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) scale_row(xp + m * ldx, wp, op + m * N, N, static_cast<float>(eps));
  });
  return out;
}

// residual += x; x = rmsnorm(residual) * w  (both in place, as the decoder layer chains them).
void fused_add_rmsnorm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, "fused_add_rmsnorm");
  check_rows(residual, "fused_add_rmsnorm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "fused_add_rmsnorm: x and residual shapes differ");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1),
              "fused_add_rmsnorm: weight must be a contiguous float32 [n]");
  const int64_t M = x.size(0), N = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  rs::parallel_for(0, M, grain_rows(N), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      float* __restrict xr = xp + m * ldx;
      float* __restrict rr = rp + m * ldr;
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) rr[i] += xr[i];
      scale_row(rr, wp, xr, N, static_cast<float>(eps));
    }
  });
}

// q [T, H, D], k [T, Hkv, D] (head_dim contiguous, any token/head strides: views of the fused qkv
// projection); cos/sin [max_position, D/2]; positions [T] int64.
void rotary_neox_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                  const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_neox: q [T, H, D] and k [T, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  k.stride(2) == 1,
              "rotary_neox: q and k must be float32 with contiguous head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary_neox: positions must be a contiguous int64 [T]");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == half && cos.sizes() == sin.sizes(),
              "rotary_neox: cos/sin must be contiguous float32 [max_position, head_dim / 2]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_neox: position ", pos[t], " outside [0, ", max_pos, ")");
  }
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t Hq = q.size(1), Hk = k.size(1);
  rs::parallel_for(0, T, grain_rows((Hq + Hk) * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      rotate_heads(qp + t * q.stride(0), Hq, q.stride(1), c, s, half);
      rotate_heads(kp + t * k.stride(0), Hk, k.stride(1), c, s, half);
    }
  });
}

// x [M, 2d] (gate then up) -> [M, d]
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t M = x.size(0), d = x.size(1) / 2, ldx = x.stride(0);
  at::Tensor out = at::empty({M, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rs::parallel_for(0, M, grain_rows(2 * d), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) silu_mul_row(xp + m * ldx, xp + m * ldx + d, op + m * d, d);
  });
  return out;
}

namespace {

// One (token, KV head) row of D floats into the pool's element type, as the pool's Python
// writer (mem_cache/kv_dtype.py) rounds it, so both paths store the same bits: bf16 and fp8 by
// c10's round-to-nearest-even conversions (fp8 saturated first), int8 as round(x / s) with
// s = amax * (1/127) per row (1 for an all-zero row), its scale stored beside it.
template <typename kv_t>
void quantize_row(const float* __restrict x, int64_t D, kv_t* __restrict dst, float* scale) {
  if constexpr (std::is_same_v<kv_t, int8_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float s = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
    for (int64_t d = 0; d < D; ++d) {
      dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / s))));
    }
    *scale = s;
  } else {
    float limit = std::numeric_limits<float>::infinity();
    if constexpr (std::is_same_v<kv_t, at::Float8_e4m3fn>) limit = 448.f;
    if constexpr (std::is_same_v<kv_t, at::Float8_e5m2>) limit = 57344.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<kv_t>(std::min(limit, std::max(-limit, x[d])));
  }
}

template <typename kv_t>
void store_kv_quantized(at::Tensor& k_buf, at::Tensor& v_buf, const int64_t* lp, const at::Tensor& k,
                        const at::Tensor& v, float* k_scale, float* v_scale) {
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  kv_t *kb = k_buf.data_ptr<kv_t>(), *vb = v_buf.data_ptr<kv_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  rs::parallel_for(0, T, grain_rows(2 * Hkv * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = lp[t] * Hkv + h;
        quantize_row(kp + t * k.stride(0) + h * D, D, kb + row * D, k_scale ? k_scale + row : nullptr);
        quantize_row(vp + t * v.stride(0) + h * D, D, vb + row * D, v_scale ? v_scale + row : nullptr);
      }
    }
  });
}

}  // namespace

// k_buf[loc[i]] = k[i], v_buf[loc[i]] = v[i]; k/v [T, Hkv, D] fp32 views (rows contiguous per
// token). fp32 pools copy; bf16 / fp8 / int8 pools quantize each row (int8: with k_scale / v_scale
// fp32 [N, Hkv], which int8 requires and other dtypes refuse).
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v,
              const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() && k_buf.dim() == 3,
              "store_kv: K/V buffers must be contiguous [N, Hkv, D] of one shape");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "store_kv: k/v must be float32 and the K/V buffers of one dtype");  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == k_buf.size(1) && k.size(2) == k_buf.size(2) &&
                  k.sizes() == v.sizes(),
              "store_kv: k/v must be [T, Hkv, D] matching the buffers");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "store_kv: each token's heads must be contiguous");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous() && loc.numel() == k.size(0),
              "store_kv: loc must be a contiguous int64 [T]");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), N = k_buf.size(0);
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] < N, "store_kv: slot ", lp[t], " out of range");
  if (k_buf.scalar_type() != at::kFloat) {
    kv_scales("store_kv", k_buf, k_scale, v_scale);  // int8 needs them, other dtypes refuse them
    float* ks = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
    float* vs = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
    dispatch_kv_dtype(k_buf.scalar_type(), "store_kv", [&](auto tag) {
      using kv_t = decltype(tag);
      if constexpr (!std::is_same_v<kv_t, float>) store_kv_quantized<kv_t>(k_buf, v_buf, lp, k, v, ks, vs);
    });
    return;
  }
  TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "store_kv: a float32 pool takes no scales");
  float *kb = k_buf.data_ptr<float>(), *vb = v_buf.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  rs::parallel_for(0, T, grain_rows(2 * row), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      std::memcpy(kb + lp[t] * row, kp + t * k.stride(0), sizeof(float) * row);
      std::memcpy(vb + lp[t] * row, vp + t * v.stride(0), sizeof(float) * row);
    }
  });
}
