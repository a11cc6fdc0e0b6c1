// y[M, N] = dequant(quant(x) @ w^T) (+ bias): the W8A8 int8 linear (--quantization w8a8_int8).
//
// w is int8 [N, K] with one fp32 scale per output row (symmetric: w_real ~= w * w_scale[n]); each
// row of x is quantized here, per token, to int8 in [-127, 127] with its own scale. The products
// are summed exactly in int32 and scaled once per output: y = dot * (x_scale[m] * w_scale[n]).
//
// Why int8 dot products rather than dequantizing the weights to fp32 in registers: at one token
// both are bound by reading the weight (1 byte per weight either way), but one VNNI instruction
// does 64 multiply-adds where the fp32 path needs a widen, a convert and an FMA per 16 weights;
// from a few tokens up the fp32 FMAs run out of ports before memory (docs/quantization.md).
//
// Paths (the same integer sums, so bit-identical outputs; `isa` forces one, for tests):
// - AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so the weight is flipped to
//   unsigned (w + 128, one xor per weight vector, shared by every row of x) and the activation
//   stays signed; 128 * sum(x_q) is subtracted at the end.
// - AVX2: vpmaddubsw on |w| and x * sign(w) (pairs stay within int16: 2 * 128 * 127 < 32767),
//   vpmaddwd to int32.
// - scalar: the rest of K, and CPUs without AVX2.
#include "common.h"
#include "ops.h"

namespace {

constexpr int64_t kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvx512 = 3;

#if RS_HAVE_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RS_HAVE_AVX512_VNNI 1
#else
#define RS_HAVE_AVX512_VNNI 0
#endif

// The quantized rows of x: int8 values (rows padded to a multiple of 64 bytes), each row's scale,
// and each row's sum over the first K / 64 * 64 values (the VNNI path's unsigned-weight correction).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> head_sum;
  int64_t ld = 0;
};

// Rows per parallel task when quantizing: small batches (decode) stay on the calling thread.
int64_t quantize_grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, K)); }

// Per row: scale = amax / 127, q = round_half_even(x * (127 / amax)), computed in this order so
// that torch's reference (layers/quantization.py) gets the same bytes.
QuantizedRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K) {
  QuantizedRows r;
  r.ld = (K + 63) / 64 * 64;
  r.q.assign(M * r.ld, 0);
  r.scale.resize(M);
  r.head_sum.resize(M);
  const int64_t K64 = K / 64 * 64;
  rs::parallel_for(0, M, quantize_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * ldx;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qr = r.q.data() + m * r.ld;
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xr[k] * inv)));
        qr[k] = static_cast<int8_t>(v);
        if (k < K64) s += static_cast<int32_t>(v);
      }
      r.scale[m] = amax / 127.f;
      r.head_sum[m] = s;
    }
  });
  return r;
}

// dot[m * NR + j] = sum_k q[m][k] * w[j][k] over k in [k0, K), scalar.
template <int NR>
inline void dot_tail(const int8_t* q, int64_t ldq, int MB, const int8_t* w, int64_t K, int64_t k0, int32_t* dot) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) {
      int32_t s = 0;
      for (int64_t k = k0; k < K; ++k) s += static_cast<int32_t>(q[m * ldq + k]) * static_cast<int32_t>(w[j * K + k]);
      dot[m * NR + j] += s;
    }
}

#if RS_HAVE_AVX512_VNNI
// MB rows of x against NR weight rows, 64 bytes of K per step; the next NR rows are prefetched.
template <int MB, int NR>
inline void tile_vnni(const QuantizedRows& xq, int64_t m0, const int8_t* w, int64_t K, int32_t* dot,
                      bool prefetch_next) {
  const int64_t K64 = K / 64 * 64, ldq = xq.ld;
  const int8_t* q = xq.q.data() + m0 * ldq;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K64; k += 64) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) {
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(w + j * K + k), flip);  // w + 128, as unsigned
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(q + m * ldq + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) dot[m * NR + j] = _mm512_reduce_add_epi32(acc[m][j]);
  // Undo the +128 over the vector part of K (the tail is summed with the signed weight).
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) dot[m * NR + j] -= 128 * xq.head_sum[m0 + m];
  dot_tail<NR>(q, ldq, MB, w, K, K64, dot);
}
#endif

#if RS_HAVE_AVX2
// One row of x against NR weight rows, 32 bytes of K per step.
template <int NR>
inline void tile_avx2(const QuantizedRows& xq, int64_t m0, const int8_t* w, int64_t K, int32_t* dot) {
  const int64_t K32 = K / 32 * 32;
  const int8_t* q = xq.q.data() + m0 * xq.ld;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K32; k += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
    for (int j = 0; j < NR; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int j = 0; j < NR; ++j) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[j]), _mm256_extracti128_si256(acc[j], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    dot[j] = _mm_cvtsi128_si32(s);
  }
  dot_tail<NR>(q, xq.ld, 1, w, K, K32, dot);
}
#endif

// y[m, n0 + j] = dot * x_scale[m] * w_scale[n0 + j] (+ bias): the one epilogue every path shares.
inline void store(const int32_t* dot, int MB, int NR, const QuantizedRows& xq, int64_t m0, const float* w_scale,
                  const float* bias, int64_t n0, float* y, int64_t ldy) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) {
      // An explicit fma: left to the compiler, `a * s + b` is contracted in some inlined copies
      // and not in others, and the paths would differ in the last bit.
      const float d = static_cast<float>(dot[m * NR + j]), s = xq.scale[m0 + m] * w_scale[n0 + j];
      y[(m0 + m) * ldy + n0 + j] = bias != nullptr ? std::fma(d, s, bias[n0 + j]) : d * s;
    }
}

struct Problem {
  const QuantizedRows& xq;
  const int8_t* w;
  const float* w_scale;
  const float* bias;
  float* y;
  int64_t M, N, K;
};

// Output columns [n0, n1) for all M rows on the chosen path.
void block(const Problem& p, int64_t isa, int64_t n0, int64_t n1) {
  const int64_t K = p.K;
  int32_t dot[4 * 8];
  int64_t n = n0;
#if RS_HAVE_AVX512_VNNI
  if (isa == kIsaAvx512) {
    if (p.M <= 2) {
      constexpr int NR = 8;  // 8 weight streams in flight, as the fp32 kernel
      for (; n + NR <= n1; n += NR) {
        const bool prefetch = n + 2 * NR <= n1;
        if (p.M == 2) {
          tile_vnni<2, NR>(p.xq, 0, p.w + n * K, K, dot, prefetch);
          store(dot, 2, NR, p.xq, 0, p.w_scale, p.bias, n, p.y, p.N);
        } else {
          tile_vnni<1, NR>(p.xq, 0, p.w + n * K, K, dot, prefetch);
          store(dot, 1, NR, p.xq, 0, p.w_scale, p.bias, n, p.y, p.N);
        }
      }
    } else {
      constexpr int NR = 6;  // 4 x 6 accumulators + 6 weights + 1 x: 31 of the 32 registers
      for (; n + NR <= n1; n += NR) {
        const int8_t* wn = p.w + n * K;
        int64_t m = 0;
        for (; m + 4 <= p.M; m += 4) {
          tile_vnni<4, NR>(p.xq, m, wn, K, dot, m == 0 && n + 2 * NR <= n1);
          store(dot, 4, NR, p.xq, m, p.w_scale, p.bias, n, p.y, p.N);
        }
        for (; m < p.M; ++m) {
          tile_vnni<1, NR>(p.xq, m, wn, K, dot, false);
          store(dot, 1, NR, p.xq, m, p.w_scale, p.bias, n, p.y, p.N);
        }
      }
    }
  }
#endif
#if RS_HAVE_AVX2
  if (isa == kIsaAvx2 || isa == kIsaAvx512) {
    constexpr int NR = 4;
    for (; n + NR <= n1; n += NR) {
      for (int64_t m = 0; m < p.M; ++m) {
        tile_avx2<NR>(p.xq, m, p.w + n * K, K, dot);
        store(dot, 1, NR, p.xq, m, p.w_scale, p.bias, n, p.y, p.N);
      }
    }
  }
#endif
  for (; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) {
      dot[0] = 0;
      dot_tail<1>(p.xq.q.data() + m * p.xq.ld, p.xq.ld, 1, p.w + n * K, K, 0, dot);
      store(dot, 1, 1, p.xq, m, p.w_scale, p.bias, n, p.y, p.N);
    }
}

int64_t best_isa() { return RS_HAVE_AVX512_VNNI ? kIsaAvx512 : RS_HAVE_AVX2 ? kIsaAvx2 : kIsaScalar; }

}  // namespace

std::vector<std::string> linear_int8_isas() { return isa_names(RS_HAVE_AVX2, RS_HAVE_AVX512_VNNI); }

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_int8: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar,
              "linear_int8: w must be a contiguous int8 [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_int8: x has K=", x.size(1), " but w has K=", w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == N,
              "linear_int8: w_scale must be a contiguous float32 [N]");
  // Exact int32 sums: the VNNI path's (w + 128) * x terms need K * 255 * 127 < 2^31.
  TORCH_CHECK(K <= (int64_t{1} << 16), "linear_int8: K=", K, " is too large for int32 accumulation");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "linear_int8: bias must be a contiguous float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  if (isa == kIsaAuto) isa = best_isa();
  TORCH_CHECK(isa == kIsaScalar || (isa == kIsaAvx2 && RS_HAVE_AVX2) || (isa == kIsaAvx512 && RS_HAVE_AVX512_VNNI),
              "linear_int8: ISA path ", isa, " is not compiled into this build");
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), x.stride(0), M, K);
  const Problem p{xq, w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), M, N, K};
  // Blocks of 96 output rows (a multiple of every tile height: 8, 6 and 4), ~54 KB of int8 at
  // K=576: enough work per task, and enough blocks to balance the threads.
  constexpr int64_t kBlock = 96;
  const int64_t num_blocks = (N + kBlock - 1) / kBlock;
  rs::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    block(p, isa, b0 * kBlock, std::min(N, b1 * kBlock));
  });
  return y;
}
