// y[M, N] = x[M, K] @ dequant(w)^T (+ bias): weight-only group-quantized linears ("wq": GGUF
// Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K, GPTQ / AWQ int4, int8 / int4 weight-only; layers/group_quant.py).
//
// w is stored as integers q with an fp32 scale (and optionally an fp32 offset) per group of
// `group_size` consecutive inputs of one output row: w = q * scale (+ offset). bits 8: q int8
// [N, K]; bits 4: q in 0..15, two per byte [N, K / 2], input 2j in byte j's low nibble, 2j + 1 in
// its high nibble. Activations and sums stay fp32 (no activation quantization), so the result is
// the dequantize-then-matmul reference's up to summation order and FMA contraction.
//
// Why dequantize in registers (w = fma(q, scale, offset) per vector, then one FMA per row of x)
// rather than the factored s * sum(x q) + o * sum(x): both read the weight once, but the factored
// form needs a multiply, an FMA and a per-group scale FMA per row of x where this needs one FMA,
// and the weight conversion is shared by every row of the register tile. At one token the
// conversion dominates the arithmetic, and for 4 bits it is cheap: a nibble indexes a 16-float
// table (the group's 16 possible weights, one FMA per group to build) with one vpermps, so an
// int4 weight costs a zero-extension, a shift and a permute per 32 (no int -> float conversion).
//
// The int4 paths read x with each block's even inputs first and odd inputs second (a copy made
// per call, M * K floats): the low nibbles of a byte vector are then the even inputs and the
// high nibbles the odd ones, with no shuffle of the weight.
//
// Scales and offsets are fp32, or both fp16 (GGUF's d and m as stored: widened exactly, the same
// weights and bits; rows_half says how).
//
// Paths (`isa` forces one, for tests): AVX-512 (16 floats per vector, int4 in blocks of 32
// inputs), AVX2 + FMA (8 floats, int4 in blocks of 16), scalar (CPUs without AVX2, and the last
// 16 int4 inputs of the AVX-512 path when K is an odd multiple of 16). Every path computes the
// same fp32 weights fma(q, scale, offset); they differ from each other in summation order only.
// Rows of the weight are contiguous, so each thread streams one contiguous range of q, scales and
// offsets (at::parallel_for gives each thread one chunk of output rows).
#include "common.h"
#include "ops.h"
#include "wq_form.h"

namespace {

constexpr int64_t kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvx512 = 3;

struct WqProblem {
  const float* x;   // [M, ldx], the caller's rows
  int64_t ldx;
  const float* xp;  // int4 vector paths: x with each block's even inputs first, [M, K]; else x
  int64_t ldxp;
  const uint8_t* q;  // row n starts at q + n * qrow
  int64_t qrow;      // bytes per row: K (8 bits) or K / 2 (4 bits)
  const float* s;    // [N, groups], or from row s_row0 on (fp16 forms: a chunk widened to fp32)
  const float* o;    // as s, or nullptr
  int64_t s_row0;    // the weight row s and o start at
  const int32_t* grp;  // grp[c]: the group of inputs [16 c, 16 c + 16)
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N]
  int64_t groups, M, N, K;
  bool int4;
};

// The fp32 weight of row n, input k: what every vector path computes in its lanes.
inline float weight_at(const WqProblem& p, int64_t n, int64_t k) {
  const uint8_t* row = p.q + n * p.qrow;
  int32_t q;
  if (p.int4) {
    const uint8_t b = row[k >> 1];
    q = (k & 1) ? (b >> 4) : (b & 0x0F);
  } else {
    q = static_cast<int8_t>(row[k]);
  }
  const int64_t g = (n - p.s_row0) * p.groups + p.grp[k >> 4];
  return std::fma(static_cast<float>(q), p.s[g], p.o != nullptr ? p.o[g] : 0.f);
}

// sum over k in [k0, K) of x[m, k] * w[n, k], scalar, on the caller's x.
inline float dot_tail(const WqProblem& p, int64_t m, int64_t n, int64_t k0) {
  float acc = 0.f;
  for (int64_t k = k0; k < p.K; ++k) acc = std::fma(p.x[m * p.ldx + k], weight_at(p, n, k), acc);
  return acc;
}

inline void store(const WqProblem& p, int64_t m, int64_t n, float v) {
  p.y[m * p.N + n] = p.bias != nullptr ? v + p.bias[n] : v;
}

void rows_scalar(const WqProblem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) store(p, m, n, dot_tail(p, m, n, 0));
}

#if RS_HAVE_AVX512
// The 16 fp32 weights of row n at the 16-input chunk starting at k (int8), or the 32 of the
// 32-input block at k as its even inputs (lo) and odd inputs (hi) (int4).
struct Weights512 {
  __m512 lo, hi;
};

template <bool kInt4>
inline Weights512 weights512(const WqProblem& p, int64_t n, int64_t k, int64_t ga, int64_t gb) {
  const __m512 zero = _mm512_setzero_ps();
  const int64_t g = (n - p.s_row0) * p.groups;
  if constexpr (kInt4) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + n * p.qrow + (k >> 1))));
    const __m512i bh = _mm512_srli_epi32(b, 4);
    // The group's 16 possible weights; vpermps reads only the low 4 bits of each index.
    const __m512 table =
        _mm512_fmadd_ps(_mm512_set1_ps(p.s[g + ga]), iota, p.o != nullptr ? _mm512_set1_ps(p.o[g + ga]) : zero);
    Weights512 w{_mm512_permutexvar_ps(b, table), _mm512_permutexvar_ps(bh, table)};
    if (gb != ga) {
      // A group boundary at the block's middle (group sizes are multiples of 16): lanes 8..15 of
      // both halves are inputs of the next group.
      const __m512 tb =
          _mm512_fmadd_ps(_mm512_set1_ps(p.s[g + gb]), iota, p.o != nullptr ? _mm512_set1_ps(p.o[g + gb]) : zero);
      w.lo = _mm512_mask_permutexvar_ps(w.lo, 0xFF00, b, tb);
      w.hi = _mm512_mask_permutexvar_ps(w.hi, 0xFF00, bh, tb);
    }
    return w;
  } else {
    const __m512i qi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + n * p.qrow + k)));
    return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(p.s[g + ga]),
                            p.o != nullptr ? _mm512_set1_ps(p.o[g + ga]) : zero),
            zero};
  }
}

// MB rows of x (from m0) against NR weight rows (from n0), 32 inputs per step for int4 and 16
// for int8. Up to 4 rows of x, each weight vector is made and then used by every row of x (the x
// vectors held in registers); from 5 rows on, the NR rows' weight vectors are made first and each
// row of x is loaded once and used by them (MB x NR accumulators leave no room for the x vectors).
// Aligned to 64 bytes: the one-row tile (plain decode at batch 1) measured 5-12% slower in some
// builds with byte-identical instructions at another offset; alignment pins its loop's placement.
template <int MB, int NR, bool kInt4>
[[gnu::aligned(64)]] inline void tile512(const WqProblem& p, int64_t m0, int64_t n0) {
  constexpr int64_t kStep = kInt4 ? 32 : 16;
  const int64_t Kv = p.K / kStep * kStep;
  const float* xb = kInt4 ? p.xp : p.x;
  const int64_t ld = kInt4 ? p.ldxp : p.ldx;
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  // The first pass over these weight rows (m0 == 0) fetches the next tile's rows at the offset it
  // reads, a cache line at a time: NR separate row streams are more than the hardware prefetcher
  // keeps up with (10-15% per decoder pass at 1-8 rows on an AMD EPYC, docs/quantization.md).
  const bool prefetch = m0 == 0 && n0 + 2 * NR <= p.N;
  for (int64_t k = 0; k < Kv; k += kStep) {
    const int64_t ga = p.grp[k >> 4], gb = kInt4 ? p.grp[(k >> 4) + 1] : ga;
    const int64_t byte = kInt4 ? k >> 1 : k;
    if (prefetch && (byte & 63) == 0) {
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(p.q + (n0 + NR + j) * p.qrow + byte), _MM_HINT_T0);
    }
    if constexpr (MB <= 4) {
      __m512 xlo[MB], xhi[MB];
      for (int m = 0; m < MB; ++m) {
        xlo[m] = _mm512_loadu_ps(xb + (m0 + m) * ld + k);
        if constexpr (kInt4) xhi[m] = _mm512_loadu_ps(xb + (m0 + m) * ld + k + 16);
      }
      for (int j = 0; j < NR; ++j) {
        const Weights512 w = weights512<kInt4>(p, n0 + j, k, ga, gb);
        for (int m = 0; m < MB; ++m) {
          acc[m][j] = _mm512_fmadd_ps(xlo[m], w.lo, acc[m][j]);
          if constexpr (kInt4) acc[m][j] = _mm512_fmadd_ps(xhi[m], w.hi, acc[m][j]);
        }
      }
    } else {
      Weights512 w[NR];
      for (int j = 0; j < NR; ++j) w[j] = weights512<kInt4>(p, n0 + j, k, ga, gb);
      for (int m = 0; m < MB; ++m) {
        const __m512 xlo = _mm512_loadu_ps(xb + (m0 + m) * ld + k);
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xlo, w[j].lo, acc[m][j]);
        if constexpr (kInt4) {
          const __m512 xhi = _mm512_loadu_ps(xb + (m0 + m) * ld + k + 16);
          for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xhi, w[j].hi, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) {
      float v = _mm512_reduce_add_ps(acc[m][j]);
      if (Kv < p.K) v += dot_tail(p, m0 + m, n0 + j, Kv);
      store(p, m0 + m, n0 + j, v);
    }
}

// Rows [m, M) of x against weight rows [n, n + NR), 4 rows of x per tile.
template <int NR, bool kInt4>
inline void rest_m512(const WqProblem& p, int64_t m, int64_t n) {
  for (; m + 4 <= p.M; m += 4) tile512<4, NR, kInt4>(p, m, n);
  switch (p.M - m) {
    case 3: tile512<3, NR, kInt4>(p, m, n); break;
    case 2: tile512<2, NR, kInt4>(p, m, n); break;
    case 1: tile512<1, NR, kInt4>(p, m, n); break;
    default: break;
  }
}

// Tile shapes by measurement (benchmark/bench_wq_linear.py --wq-only, one thread, AMD EPYC Zen 5;
// docs/quantization.md): 8 weight rows per tile for one row of x (two for int8); from there, 4 x 4
// tiles (4 rows of x held in registers), and for int8 8 x 2 tiles over each 8 rows of x. For int4
// the 8 x 2 and 2 x 8 tiles were slower than 4 x 4 passes (8 rows 19.8-20.5 against 15.7-15.8 ms
// per decoder pass, 2 rows 8.0-8.2 against 5.7 ms): its conversion (a shift and two permutes per 32 weights) is
// not what bounds those shapes.
template <bool kInt4>
void rows512(const WqProblem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M == 1 || (p.M == 2 && !kInt4)) {
    // 8 weight rows in flight per thread; 16 accumulators at most.
    for (; n + 8 <= n1; n += 8) rest_m512<8, kInt4>(p, 0, n);
  } else {
    for (; n + 4 <= n1; n += 4) {
      int64_t m = 0;
      // int8: 8 x 2 tiles, each weight vector made once per 8 rows of x (the 4 x 4 tile, 4 x 4
      // accumulators and 8 x vectors, makes it once per 4); the rest of x in 4 x 4 tiles.
      if constexpr (!kInt4) {
        for (; m + 8 <= p.M; m += 8) {
          tile512<8, 2, kInt4>(p, m, n);
          tile512<8, 2, kInt4>(p, m, n + 2);
        }
      }
      rest_m512<4, kInt4>(p, m, n);
    }
  }
  for (; n < n1; ++n) rest_m512<1, kInt4>(p, 0, n);
}
#endif

#if RS_HAVE_AVX2
// The AVX2 tile: MB rows of x against NR weight rows, 16 inputs per step (int4: one 8-byte load
// per row, low nibbles the block's 8 even inputs, high nibbles its 8 odd ones).
template <int MB, int NR, bool kInt4>
inline void tile256(const WqProblem& p, int64_t m0, int64_t n0) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = zero;
  // As tile512's, for tiles of several weight rows (one row at a time is one sequential stream).
  // Written out in both tiles: a shared inline helper, prefetch_rows(p, n, count, byte), measured
  // as if there were no prefetch (AVX2 Q8_0 one row 22.8 against 9.5 ms, same process, AMD EPYC).
  const bool prefetch = NR > 1 && m0 == 0 && n0 + 2 * NR <= p.N;
  for (int64_t k = 0; k < p.K; k += 16) {
    const int64_t ga = p.grp[k >> 4];
    const float* xb = kInt4 ? p.xp : p.x;
    const int64_t ld = kInt4 ? p.ldxp : p.ldx;
    const int64_t byte = kInt4 ? k >> 1 : k;
    if (prefetch && (byte & 63) == 0) {
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(p.q + (n0 + NR + j) * p.qrow + byte), _MM_HINT_T0);
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + j, g = (n - p.s_row0) * p.groups + ga;
      const __m256 sv = _mm256_set1_ps(p.s[g]);
      const __m256 ov = p.o != nullptr ? _mm256_set1_ps(p.o[g]) : zero;
      __m256 w0, w1;
      if constexpr (kInt4) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + n * p.qrow + (k >> 1))));
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), sv, ov);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sv, ov);
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + n * p.qrow + k));
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), sv, ov);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw))), sv, ov);
      }
      for (int m = 0; m < MB; ++m) {
        const float* xr = xb + (m0 + m) * ld + k;
        acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NR; ++j) store(p, m0 + m, n0 + j, hsum(acc[m][j]));
}

template <int NR, bool kInt4>
inline void all_m256(const WqProblem& p, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= p.M; m += 2) tile256<2, NR, kInt4>(p, m, n);
  if (m < p.M) tile256<1, NR, kInt4>(p, m, n);
}

// One weight row against every row of x, up to 8 rows of x per tile (8 accumulators, the two
// weight vectors and the constants fit the 16 ymm registers; x is read from memory by the FMAs).
template <bool kInt4>
inline void tall_m256(const WqProblem& p, int64_t n) {
  int64_t m = 0;
  for (; m + 8 <= p.M; m += 8) tile256<8, 1, kInt4>(p, m, n);
  switch (p.M - m) {
    case 7: tile256<7, 1, kInt4>(p, m, n); break;
    case 6: tile256<6, 1, kInt4>(p, m, n); break;
    case 5: tile256<5, 1, kInt4>(p, m, n); break;
    case 4: tile256<4, 1, kInt4>(p, m, n); break;
    case 3: tile256<3, 1, kInt4>(p, m, n); break;
    case 2: tile256<2, 1, kInt4>(p, m, n); break;
    case 1: tile256<1, 1, kInt4>(p, m, n); break;
    default: break;
  }
}

template <bool kInt4>
void rows256(const WqProblem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M >= 3) {
    // Each weight vector made once per up to 8 rows of x rather than once per 2 (the 2 x 4 tile):
    // a speculative verify step's rows cost FMAs, not conversions.
    for (; n < n1; ++n) tall_m256<kInt4>(p, n);
    return;
  }
  for (; n + 4 <= n1; n += 4) all_m256<4, kInt4>(p, n);
  for (; n < n1; ++n) all_m256<1, kInt4>(p, n);
}
#endif

void rows(const WqProblem& p, int64_t isa, int64_t n0, int64_t n1) {
#if RS_HAVE_AVX512
  if (isa == kIsaAvx512) return p.int4 ? rows512<true>(p, n0, n1) : rows512<false>(p, n0, n1);
#endif
#if RS_HAVE_AVX2
  if (isa == kIsaAvx2) return p.int4 ? rows256<true>(p, n0, n1) : rows256<false>(p, n0, n1);
#endif
  rows_scalar(p, n0, n1);
}

// fp16 scales and offsets (GGUF's own d and m: half the bytes of fp32 ones, ~1/6 of a Q4_1
// weight's), widened to fp32 exactly, so the paths above compute the same weights, bit for bit,
// as from an fp32 copy of the same values. Widened by chunks of kHalfChunk weight rows into a
// buffer that stays in L1 (one row's groups at a time would cost a call per row; the whole
// range, a second pass over memory), ahead of the tiles that read them.
constexpr int64_t kHalfChunk = 8;  // a multiple of every tile height (rows512, rows256)

void widen(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if RS_HAVE_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void rows_half(const WqProblem& p, const at::Half* s, const at::Half* o, int64_t isa, int64_t n0, int64_t n1) {
  const int64_t span = kHalfChunk * p.groups;
  std::vector<float> buf(o != nullptr ? 2 * span : span);
  WqProblem c = p;
  c.s = buf.data();
  c.o = o != nullptr ? buf.data() + span : nullptr;
  for (int64_t n = n0; n < n1; n += kHalfChunk) {
    const int64_t end = std::min(n1, n + kHalfChunk), len = (end - n) * p.groups;
    widen(s + n * p.groups, buf.data(), len);
    if (o != nullptr) widen(o + n * p.groups, buf.data() + span, len);
    c.s_row0 = n;
    rows(c, isa, n, end);
  }
}

// x with each `block` of inputs reordered as its even inputs, then its odd ones (the rest of K,
// shorter than a block, copied as it is).
std::vector<float> even_odd_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t block) {
  std::vector<float> xp(M * K);
  const int64_t Kb = K / block * block, half = block / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * ldx;
    float* dst = xp.data() + m * K;
    for (int64_t k = 0; k < Kb; k += block)
      for (int64_t j = 0; j < half; ++j) {
        dst[k + j] = src[k + 2 * j];
        dst[k + half + j] = src[k + 2 * j + 1];
      }
    for (int64_t k = Kb; k < K; ++k) dst[k] = src[k];
  }
  return xp;
}

int64_t best_isa() { return RS_HAVE_AVX512 ? kIsaAvx512 : RS_HAVE_AVX2 ? kIsaAvx2 : kIsaScalar; }

}  // namespace

std::vector<std::string> linear_wq_isas() { return isa_names(RS_HAVE_AVX2, RS_HAVE_AVX512); }

at::Tensor linear_wq(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, int64_t isa) {
  const WqForm f = check_wq_form("linear_wq", x, qweight, scales, offsets, bits, group_size, bias, 16, true);
  const int64_t M = f.M, K = f.K, N = f.N, groups = f.groups;
  if (isa == kIsaAuto) isa = best_isa();
  TORCH_CHECK(isa == kIsaScalar || (isa == kIsaAvx2 && RS_HAVE_AVX2) || (isa == kIsaAvx512 && RS_HAVE_AVX512),
              "linear_wq: ISA path ", isa, " is not compiled into this build");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // One entry per 16 inputs plus one past the end (the int4 AVX-512 block reads its second half's).
  std::vector<int32_t> grp(K / 16 + 1);
  for (int64_t c = 0; c < static_cast<int64_t>(grp.size()); ++c)
    grp[c] = static_cast<int32_t>(std::min(groups - 1, c * 16 / group_size));
  const float* x_ptr = x.data_ptr<float>();
  std::vector<float> xp;
  const bool int4 = bits == 4;
  if (int4 && isa != kIsaScalar) xp = even_odd_rows(x_ptr, x.stride(0), M, K, isa == kIsaAvx512 ? 32 : 16);
  const WqProblem p{x_ptr,
                    x.stride(0),
                    xp.empty() ? x_ptr : xp.data(),
                    xp.empty() ? x.stride(0) : K,
                    reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                    qweight.size(1),
                    f.half ? nullptr : scales.data_ptr<float>(),
                    f.half ? nullptr : static_cast<const float*>(f.offsets),
                    0,
                    grp.data(),
                    f.bias,
                    y.data_ptr<float>(),
                    groups,
                    M,
                    N,
                    K,
                    int4};
  // Units of 8 output rows (a multiple of every tile height); each thread takes one contiguous
  // run of them, and runs of less than ~16 KB of weight stay on one thread.
  constexpr int64_t kUnit = 8;
  const int64_t units = (N + kUnit - 1) / kUnit;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (kUnit * p.qrow));
  static_assert(kUnit % kHalfChunk == 0, "a thread's run starts at a chunk of rows_half");
  const auto* s_half = f.half ? scales.data_ptr<at::Half>() : nullptr;
  const auto* o_half = f.half ? static_cast<const at::Half*>(f.offsets) : nullptr;
  rs::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * kUnit, n1 = std::min(N, u1 * kUnit);
    if (f.half) return rows_half(p, s_half, o_half, isa, n0, n1);
    rows(p, isa, n0, n1);
  });
  return y;
}
