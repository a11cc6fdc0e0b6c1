// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for small M, w in fp32 or fp16, all math in fp32.
//
// Why: a decode step of a small batch is bound by reading the weights (the whole model, every
// step). This kernel streams each weight row once through a register tile (4 weight rows x 2 x
// rows, 8 independent FMA chains) and reaches ~27 GB/s here, where torch's GEMM reads ~15 GB/s
// at M=1 and less at M=2..16. Storing the weights in fp16 halves the bytes again; F16C converts
// 8 halves to 8 floats in one instruction, hidden under the memory traffic (llama.cpp's F16
// trick; torch's own half/bf16 GEMMs run at a fraction of fp32 speed on this class of CPU).
// Large M is compute-bound and stays with torch's GEMM (layers/linear.py picks).
#include "common.h"
#include "ops.h"

namespace {

constexpr int64_t kRowsPerTile = 4;  // weight rows (outputs) per register tile
constexpr int64_t kBatchPerTile = 2;  // x rows per register tile: 8 accumulators + 4 w + 1 x

#if RS_HAVE_AVX2
// Full tile: MB x rows against kRowsPerTile weight rows; K8 = K rounded down to 8.
template <int MB, typename w_t>
inline void tile(const float* x, int64_t ldx, const w_t* w, int64_t K, int64_t K8, float* y, int64_t ldy) {
  __m256 acc[MB][kRowsPerTile];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kRowsPerTile; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[kRowsPerTile];
    for (int j = 0; j < kRowsPerTile; ++j) wv[j] = load8(w + j * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int j = 0; j < kRowsPerTile; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < kRowsPerTile; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t k = K8; k < K; ++k) s += x[m * ldx + k] * static_cast<float>(w[j * K + k]);
      y[m * ldy + j] = s;
    }
  }
}
#endif

#if RS_HAVE_AVX512
// The AVX-512 tile: 8 weight rows (8 streams in flight per thread, and the next tile's rows
// prefetched) x MB rows of x, 16 floats per step; measured 1.2x (fp32) and 1.3-1.6x (fp16) over
// the AVX2 tile on the built-in model's decode (docs/benchmarks.md).
constexpr int64_t kRowsPerTile512 = 8;
constexpr int64_t kRowsPerTile512Wide = 6;  // for 3 or more rows of x

// MB rows of x against NR weight rows; the next NR weight rows are prefetched when asked.
template <int MB, int NR, typename w_t>
inline void tile512(const float* x, int64_t ldx, const w_t* w, int64_t K, int64_t K16, float* y, int64_t ldy,
                    bool prefetch_next) {
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
      wv[j] = load16(w + j * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NR; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t k = K16; k < K; ++k) s += x[m * ldx + k] * static_cast<float>(w[j * K + k]);
      y[m * ldy + j] = s;
    }
  }
}
#endif

template <typename w_t>
inline float dot_scalar(const float* x, const w_t* w, int64_t K) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * static_cast<float>(w[k]);
  return s;
}

// Output columns [n0, n1) for all M rows.
template <typename w_t>
void linear_block(const float* x, int64_t ldx, const w_t* w, const float* bias, float* y, int64_t ldy,
                  int64_t M, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
#if RS_HAVE_AVX512
  const int64_t K16 = K / 16 * 16;
  if (M <= 2) {
    for (; n + kRowsPerTile512 <= n1; n += kRowsPerTile512) {
      // Prefetching helps the fp16 stream and slows the fp32 one at one or two rows (measured).
      const bool prefetch_next = sizeof(w_t) == 2 && n + 2 * kRowsPerTile512 <= n1;
      if (M == 2) {
        tile512<2, kRowsPerTile512>(x, ldx, w + n * K, K, K16, y + n, ldy, prefetch_next);
      } else {
        tile512<1, kRowsPerTile512>(x, ldx, w + n * K, K, K16, y + n, ldy, prefetch_next);
      }
    }
  } else {
    // 4 x rows x 6 weight rows: 24 accumulators, and each weight row read from memory once
    // for every 4 rows of x (the 2 x 8 tile re-read it from L1 for every 2, and ran out of
    // FMA ports before memory at 4-16 rows).
    for (; n + kRowsPerTile512Wide <= n1; n += kRowsPerTile512Wide) {
      const bool prefetch_next = n + 2 * kRowsPerTile512Wide <= n1;
      const w_t* wn = w + n * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        tile512<4, kRowsPerTile512Wide>(x + m * ldx, ldx, wn, K, K16, y + m * ldy + n, ldy, prefetch_next && m == 0);
      }
      for (; m + 2 <= M; m += 2) tile512<2, kRowsPerTile512Wide>(x + m * ldx, ldx, wn, K, K16, y + m * ldy + n, ldy, false);
      for (; m < M; ++m) tile512<1, kRowsPerTile512Wide>(x + m * ldx, ldx, wn, K, K16, y + m * ldy + n, ldy, false);
    }
  }
#endif
#if RS_HAVE_AVX2
  const int64_t K8 = K / 8 * 8;
  for (; n + kRowsPerTile <= n1; n += kRowsPerTile) {
    int64_t m = 0;
    for (; m + kBatchPerTile <= M; m += kBatchPerTile) {
      tile<kBatchPerTile, w_t>(x + m * ldx, ldx, w + n * K, K, K8, y + m * ldy + n, ldy);
    }
    for (; m < M; ++m) tile<1, w_t>(x + m * ldx, ldx, w + n * K, K, K8, y + m * ldy + n, ldy);
  }
#endif
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot_scalar(x + m * ldx, w + n * K, K);
  if (bias != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = n0; j < n1; ++j) y[m * ldy + j] += bias[j];
}

template <typename w_t>
at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear: w must be a contiguous [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "linear: x has K=", x.size(1), " but w has K=", w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "linear: bias must be a contiguous float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const w_t* w_ptr = w.data_ptr<w_t>();
  float* y_ptr = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Split N in tile-aligned blocks; a block of 64 rows (~74 KB of fp16 at K=576) amortizes the
  // per-task overhead while leaving enough blocks to balance the threads.
  constexpr int64_t kBlock = 64;
  const int64_t num_blocks = (N + kBlock - 1) / kBlock;
  rs::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    linear_block<w_t>(x_ptr, ldx, w_ptr, bias_ptr, y_ptr, N, M, K, b0 * kBlock, std::min(N, b1 * kBlock));
  });
  return y;
}

}  // namespace

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kHalf, "linear_f16: w must be float16");
  return linear_small_m<at::Half>(x, w, bias);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32: w must be float32");
  return linear_small_m<float>(x, w, bias);
}
