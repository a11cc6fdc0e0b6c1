// y[M, N] = quant8(x)[M, K] @ dequant(w)^T (+ bias): the weight-only quantized linear of
// linear_wq.cpp with its activations quantized to int8 per block of 32 inputs, as llama.cpp's
// Q4_0 x Q8_0 / Q8_0 x Q8_0 dot products do (opt-in: --cpu-wq-int8-activations).
//
// Why: on AVX2 without VNNI (an AMD EPYC Zen 1 here: every 256-bit op is two 128-bit halves)
// linear_wq's fp32 path spends per 16 weights a widen, a mask or shift, two int -> float converts,
// two dequantizing FMAs and two FMAs per row of x: one decode token ran at ~4 G weights/s per core,
// far below the bytes bound (docs/benchmarks.md, "MoE GGUF side by side"). Here 32 weights cost a
// 16-byte load, a shift, a mask, one vpmaddubsw, one vpmaddwd, one convert and one FMA per row.
//
// Numerics: x block b of row m is quantized as in layers/quantization.py (scale amax / 127,
// q = round_half_even(x * (127 / amax))); within a block the products q_w * q_x are summed exactly
// in int32, so y = sum over blocks of s_x * (s_w * dot + o_w * sum(q_x)) equals the reference
// "dequantize x's int8 blocks, dequantize w, fp32 matmul" up to fp32 summation order
// (layers/group_quant.py: linear_wq_a8_reference).
//
// VNNI (AVX512VL + AVX512_VNNI, isa 3): vpdpbusd does vpmaddubsw + vpmaddwd + add in one
// instruction, each int32 lane the sum of the same 4 consecutive products as the AVX2 pair, so
// both paths give the same bits. It multiplies unsigned by signed bytes: int4 weights are unsigned
// already; int8 weights are read as w + 128 (one xor) and the lane starts at -128 * its 4 x bytes'
// sum (one vpdpbusd per row of x and block, shared by the weight rows).
//
// Layout: as linear_wq's (int4: input 2j of a row in byte j's low nibble, 2j + 1 in its high one).
// The 16 bytes of one 32-input int4 block unpack to [low nibbles | high nibbles], its even inputs
// then its odd ones, so the quantized x is stored in that order per block (int8 weights: in order).
#include "common.h"
#include "linear_wq_a8.h"
#include "linear_wq_a8_quant.h"
#include "wq_form.h"

namespace {

struct A8Problem {
  const BlockQuantRows* xq;
  const uint8_t* q;  // row n starts at q + n * qrow
  int64_t qrow;
  const float* s;  // [N, groups]
  const float* o;  // [N, groups] or nullptr
  const float* bias;
  float* y;
  int64_t groups, blocks_per_group, M, N, K;
  bool int4;
};

// The 32 weight integers of block b of row n, in the order quantize_blocks stored x's.
inline int32_t weight_int(const A8Problem& p, int64_t n, int64_t b, int64_t i) {
  const uint8_t* row = p.q + n * p.qrow;
  // Read as int8 (not a uint8 cast to int8): GCC 12 at -O3 -march=native on AVX512_VNNI
  // vectorized the cast form of rows_scalar's sum with vpdpbusd, taking the weights as unsigned
  // (-1 read as 255; test_linear_wq_a8's scalar int8 cases failed on Zen 4).
  if (!p.int4) return reinterpret_cast<const int8_t*>(row)[b * kBlock + i];
  const uint8_t byte = row[b * (kBlock / 2) + (i & (kBlock / 2 - 1))];
  return i < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
}

inline void store(const A8Problem& p, int64_t m, int64_t n, float v) {
  p.y[m * p.N + n] = p.bias != nullptr ? v + p.bias[n] : v;
}

// sum over groups of o_w * gsum: the weight offsets' part of output (m, n).
inline float offset_term(const A8Problem& p, int64_t m, int64_t n) {
  if (p.o == nullptr) return 0.f;
  const float* o = p.o + n * p.groups;
  const float* gs = p.xq->gsum.data() + m * p.groups;
  float v = 0.f;
  for (int64_t g = 0; g < p.groups; ++g) v = std::fma(o[g], gs[g], v);
  return v;
}

void rows_scalar(const A8Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / kBlock;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xb = p.xq->q.data() + m * p.K + b * kBlock;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += weight_int(p, n, b, i) * static_cast<int32_t>(xb[i]);
        acc += p.xq->scale[m * nb + b] * p.s[n * p.groups + b / p.blocks_per_group] * static_cast<float>(dot);
      }
      store(p, m, n, acc + offset_term(p, m, n));
    }
}

#if RS_HAVE_AVX2
// The 32 weights of block b of row n as bytes: int4 unsigned 0..15 ([low nibbles | high nibbles]),
// int8 signed.
inline __m256i weight_bytes(const A8Problem& p, int64_t n, int64_t b) {
  const uint8_t* row = p.q + n * p.qrow;
  if (p.int4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
}

// 8 int32 partial sums of w . x over one block. int4: w is unsigned, vpmaddubsw takes it as is
// (pairs at most 2 * 15 * 127); int8: |w| against x * sign(w) (pairs at most 2 * 128 * 127).
template <bool kInt4>
inline __m256i block_dot(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kInt4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
}

#if RS_HAVE_A8_VNNI
// block_dot's 8 lanes by vpdpbusd. int8: w arrives as w + 128 (unsigned) and corr is -128 times
// each lane's 4 x bytes' sum, so the lanes are block_dot's exactly.
template <bool kInt4>
inline __m256i block_dot_vnni(__m256i w, __m256i x, __m256i corr) {
  if constexpr (kInt4) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
  return _mm256_dpbusd_epi32(corr, w, x);
}
#endif

// MB rows of x against NR weight rows; each weight block is unpacked once for the MB rows, each
// block scale of x broadcast once for the NR weight rows. The weight offsets' part is added at the
// end (offset_term). kVnni: the integer dots by vpdpbusd (the same int32 lanes).
template <int MB, int NR, bool kInt4, bool kVnni>
inline void tile_a8(const A8Problem& p, int64_t m0, int64_t n0) {
  const int64_t nb = p.K / kBlock;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t gcol = b / p.blocks_per_group;
    __m256i xv[MB], corr[MB];
    __m256 sx[MB];
    for (int m = 0; m < MB; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq->q.data() + (m0 + m) * p.K + b * kBlock));
      sx[m] = _mm256_set1_ps(p.xq->scale[(m0 + m) * nb + b]);
      corr[m] = _mm256_setzero_si256();
#if RS_HAVE_A8_VNNI
      if constexpr (kVnni && !kInt4)
        corr[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), flip, xv[m]));
#endif
    }
    for (int j = 0; j < NR; ++j) {
      __m256i w = weight_bytes(p, n0 + j, b);
      if constexpr (kVnni && !kInt4) w = _mm256_xor_si256(w, flip);  // w + 128, as unsigned
      const __m256 sw = _mm256_set1_ps(p.s[(n0 + j) * p.groups + gcol]);
      for (int m = 0; m < MB; ++m) {
        __m256i dot;
#if RS_HAVE_A8_VNNI
        if constexpr (kVnni) dot = block_dot_vnni<kInt4>(w, xv[m], corr[m]);
        else
#endif
          dot = block_dot<kInt4>(w, xv[m]);
        const __m256 d = _mm256_cvtepi32_ps(dot);
        acc[m][j] = _mm256_fmadd_ps(d, _mm256_mul_ps(sw, sx[m]), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) store(p, m0 + m, n0 + j, hsum(acc[m][j]) + offset_term(p, m0 + m, n0 + j));
}

template <int NR, bool kInt4, bool kVnni>
inline void all_m_a8(const A8Problem& p, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= p.M; m += 2) tile_a8<2, NR, kInt4, kVnni>(p, m, n);
  if (m < p.M) tile_a8<1, NR, kInt4, kVnni>(p, m, n);
}

// 4 weight rows per tile, 2 rows of x (8 accumulators). From ~3 rows of x on this path is no
// faster than linear_wq's on Zen 1 (vpmaddubsw and vpmaddwd per row and block cost what the fp32
// FMAs do; the saving is the weight conversion, shared by the rows there too): layers/group_quant.py
// sends it at most A8_MAX_ROWS rows.
template <bool kInt4, bool kVnni>
void rows_simd(const A8Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) all_m_a8<4, kInt4, kVnni>(p, n);
  for (; n < n1; ++n) all_m_a8<1, kInt4, kVnni>(p, n);
}
#endif

void rows(const A8Problem& p, int64_t isa, int64_t n0, int64_t n1) {
#if RS_HAVE_A8_VNNI
  if (isa == kA8IsaVnni) return p.int4 ? rows_simd<true, true>(p, n0, n1) : rows_simd<false, true>(p, n0, n1);
#endif
#if RS_HAVE_AVX2
  if (isa == kA8IsaAvx2) return p.int4 ? rows_simd<true, false>(p, n0, n1) : rows_simd<false, false>(p, n0, n1);
#endif
  rows_scalar(p, n0, n1);
}

}  // namespace

std::vector<std::string> linear_wq_a8_isas() { return isa_names(RS_HAVE_AVX2, RS_HAVE_A8_VNNI); }

at::Tensor linear_wq_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, int64_t isa) {
  const WqForm f = check_wq_form("linear_wq_a8", x, qweight, scales, offsets, bits, group_size, bias, kBlock);
  const int64_t M = f.M, K = f.K, N = f.N, groups = f.groups;
  isa = a8_resolve_isa("linear_wq_a8", isa, true);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool int4 = bits == 4;
  const BlockQuantRows xq = quantize_blocks(x.data_ptr<float>(), x.stride(0), M, K, group_size, int4 ? A8Order::kEvenOdd : A8Order::kNatural);
  const A8Problem p{&xq,
                    reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                    qweight.size(1),
                    scales.data_ptr<float>(),
                    static_cast<const float*>(f.offsets),  // fp32: check_wq_form allows no fp16 here
                    f.bias,
                    y.data_ptr<float>(),
                    groups,
                    group_size / kBlock,
                    M,
                    N,
                    K,
                    int4};
  // As linear_wq: units of 8 output rows, runs of less than ~16 KB of weight on one thread.
  constexpr int64_t kUnit = 8;
  const int64_t units = (N + kUnit - 1) / kUnit;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (kUnit * p.qrow));
  rs::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    rows(p, isa, u0 * kUnit, std::min(N, u1 * kUnit));
  });
  return y;
}
