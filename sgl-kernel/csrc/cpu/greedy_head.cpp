// Candidates for the exact argmax of each row of y = x @ w^T, for a greedy LM head: a cheap
// integer pass over an int8 copy of the weight scores every vocabulary row with a proven error
// bound, and only the rows that could still be the maximum are returned, for the caller to
// score exactly with the head's own kernel (layers/greedy_head.py says why and how).
//
// The copy: w ~= t[n] * u[n, k], u int8 with one scale per row (made by the caller from the fp32
// weight w; stats[n] = (t, delta, omega) with delta >= ||w - t u||_2 and omega >= ||t u||_2). Each
// row of x is quantized here to int16: x ~= sx * r. Then
//   A = t * sx * sum_k u r    (an exact integer sum, so every path gives the same A)
//   |fl(x . w) - A| <= delta ||x|| + omega ||x - sx r|| + gamma_K (omega + delta) ||x|| =: B
// (Cauchy-Schwarz on the two quantization errors; gamma_K bounds the fp32 summation error of any
// order of K products, the exact kernel's included). The true maximum v then has
// A_v + B_v >= max_n (A_n - B_n), and so does every row tied with it: those rows are the candidates.
//
// Integer sums stay exact in int32: each row's r is scaled so that umax * ||r|| < 2^31 (umax >=
// every ||u_n||), which bounds every partial sum of |u r| (Cauchy-Schwarz again).
//
// Paths (`isa` forces one, for tests; all give the same integers): AVX-512BW (vpdpwssd with VNNI,
// else vpmaddwd + add), AVX2 (vpmaddwd + add), scalar (the tail of K, and CPUs without AVX2).
#include "common.h"
#include "ops.h"

namespace {

constexpr int64_t kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvx512 = 3;

#if RS_HAVE_AVX512 && defined(__AVX512BW__)
#define RS_GH_AVX512 1
#else
#define RS_GH_AVX512 0
#endif

struct Rows {  // the int16 rows of x and what the bound needs of each
  std::vector<int16_t> r;  // [M, ld]
  std::vector<double> sx, xnorm, qerr;  // scale, ||x||, ||x - sx r||
  int64_t ld = 0;
  bool finite = true;
};

Rows quantize(const float* x, int64_t ldx, int64_t M, int64_t K, double umax) {
  Rows q;
  q.ld = (K + 31) / 32 * 32;
  q.r.assign(M * q.ld, 0);
  q.sx.assign(M, 1.0);
  q.xnorm.assign(M, 0.0);
  q.qerr.assign(M, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    double amax = 0.0, ss = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      amax = std::max(amax, std::fabs(static_cast<double>(xr[k])));
      ss += static_cast<double>(xr[k]) * xr[k];
    }
    if (!std::isfinite(ss)) {
      q.finite = false;
      return q;
    }
    q.xnorm[m] = std::sqrt(ss);
    if (amax == 0.0) continue;
    // ||r|| <= R ||x|| / amax + sqrt(K) / 2 (rounding), kept under 2e9 / umax.
    const double room = (2.0e9 / umax - std::sqrt(static_cast<double>(K)) / 2) * amax / q.xnorm[m];
    const double R = std::min(32767.0, std::floor(room));
    if (R < 1.0) {
      q.finite = false;  // no safe scale: the caller scores every row exactly
      return q;
    }
    const float sx = static_cast<float>(amax / R);
    int16_t* rr = q.r.data() + m * q.ld;
    double err = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(xr[k] / sx);
      rr[k] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, v)));
      const double e = xr[k] - static_cast<double>(sx) * rr[k];  // sx * r is exact in double
      err += e * e;
    }
    q.sx[m] = sx;
    q.qerr[m] = std::sqrt(err);
  }
  return q;
}

// u is packed by tiles of 4 vocabulary rows: [Np / 4][Kp / 32][4][32] (Np, Kp: N and K rounded
// up to 4 and 32, zero padded), so a tile's 4 rows are one sequential stream (4 separate row
// streams ran at a third of the memory's speed on the development machine).
constexpr int64_t kTileBytesPerStep = 4 * 32;
constexpr int64_t kAhead = 4;  // tiles between a tile's prefetch and its use

struct Problem {
  const Rows& x;
  const int8_t* u;  // packed, see above
  const float* stats;  // [N, 3]: t, delta, omega
  float* a;  // [M, N]
  float* b;  // [M, N]
  int64_t M, N, K, Kp;
  double gamma;

  const int8_t* tile_at(int64_t n) const { return u + (n / 4) * Kp * 4; }
  const int16_t* row(int64_t m) const { return x.r.data() + m * x.ld; }
};

// A and its bound B for row m, vocabulary row n, from the exact integer sum. Plain arithmetic
// (no nextafter / ldexp calls): this runs once per (row, vocabulary row).
inline void store(const Problem& p, int64_t m, int64_t n, int64_t dot) {
  const float* st = p.stats + 3 * n;
  const double t = st[0], delta = st[1], omega = st[2];
  const double a = static_cast<double>(dot) * t * p.x.sx[m];
  const double xn = p.x.xnorm[m];
  double b = (delta * xn + omega * p.x.qerr[m] + p.gamma * (omega + delta) * xn) * (1 + 1e-5);
  b += std::fabs(a) * 0x1p-22 + 1e-30;  // covers rounding A to float (and this arithmetic)
  p.a[m * p.N + n] = static_cast<float>(a);
  p.b[m * p.N + n] = static_cast<float>(b * (1 + 0x1p-20));  // rounds to a float >= b
}

void tile_scalar(const Problem& p, int64_t m0, int MB, int64_t n, int64_t* out) {
  const int8_t* t = p.tile_at(n);
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) {
      const int16_t* r = p.row(m0 + i);
      int64_t s = 0;
      for (int64_t k = 0; k < p.Kp; ++k) s += static_cast<int64_t>(r[k]) * t[(k / 32) * kTileBytesPerStep + j * 32 + k % 32];
      out[j * 4 + i] = s;
    }
}

#if RS_GH_AVX512
// The tile's 4 vocabulary rows against MB rows of x, 32 inputs per step.
template <int MB>
void tile512(const Problem& p, int64_t m0, int64_t n, int64_t* out, bool prefetch) {
  __m512i acc[4][MB];
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_si512();
  const int8_t* t = p.tile_at(n);
  const int64_t ahead = kAhead * p.Kp * 4;
  for (int64_t k = 0; k < p.Kp; k += 32, t += kTileBytesPerStep) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(t + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(t + ahead + 64), _MM_HINT_T0);
    }
    __m512i w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * j)));
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(p.row(m0 + i) + k);
      for (int j = 0; j < 4; ++j) {
#if defined(__AVX512VNNI__)
        acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], xv, w[j]);
#else
        acc[j][i] = _mm512_add_epi32(acc[j][i], _mm512_madd_epi16(xv, w[j]));
#endif
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) out[j * 4 + i] = _mm512_reduce_add_epi32(acc[j][i]);
}
#endif

#if RS_HAVE_AVX2
template <int MB>
void tile256(const Problem& p, int64_t m0, int64_t n, int64_t* out, bool prefetch) {
  __m256i acc[4][MB];
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm256_setzero_si256();
  const int8_t* t = p.tile_at(n);
  const int64_t ahead = kAhead * p.Kp * 4;
  for (int64_t k = 0; k < p.Kp; k += 32, t += kTileBytesPerStep) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(t + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(t + ahead + 64), _MM_HINT_T0);
    }
    for (int h = 0; h < 2; ++h) {  // the two 16-input halves of the step
      __m256i w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 * j + 16 * h)));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.row(m0 + i) + k + 16 * h));
        for (int j = 0; j < 4; ++j) acc[j][i] = _mm256_add_epi32(acc[j][i], _mm256_madd_epi16(xv, w[j]));
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[j][i]), _mm256_extracti128_si256(acc[j][i], 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      out[j * 4 + i] = _mm_cvtsi128_si32(s);
    }
}
#endif

template <int MB>
void tile(const Problem& p, int64_t isa, int64_t m0, int64_t n, bool prefetch) {
  int64_t dot[16];
#if RS_GH_AVX512
  if (isa == kIsaAvx512) {
    tile512<MB>(p, m0, n, dot, prefetch);
  } else
#endif
#if RS_HAVE_AVX2
      if (isa == kIsaAvx2) {
    tile256<MB>(p, m0, n, dot, prefetch);
  } else
#endif
  {
    tile_scalar(p, m0, MB, n, dot);
  }
  for (int j = 0; j < 4 && n + j < p.N; ++j)
    for (int i = 0; i < MB; ++i) store(p, m0 + i, n + j, dot[j * 4 + i]);
}

// Vocabulary rows [n0, n1), n0 a multiple of 4.
void rows(const Problem& p, int64_t isa, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += 4) {
    // The first pass over a tile fetches the tile kAhead further on.
    const bool prefetch = n + 4 * (kAhead + 1) <= p.N;
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) tile<4>(p, isa, m, n, prefetch && m == 0);
    for (; m < p.M; ++m) tile<1>(p, isa, m, n, prefetch && m == 0);
  }
}

int64_t best_isa() { return RS_GH_AVX512 ? kIsaAvx512 : RS_HAVE_AVX2 ? kIsaAvx2 : kIsaScalar; }

}  // namespace

std::vector<std::string> greedy_head_isas() {
  std::vector<std::string> isas{"scalar"};
  if (RS_HAVE_AVX2) isas.emplace_back("avx2");
  if (RS_GH_AVX512) isas.emplace_back("avx512");
  return isas;
}

std::tuple<at::Tensor, at::Tensor> greedy_head_candidates(const at::Tensor& x, const at::Tensor& u,
                                                          const at::Tensor& stats, double umax, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "greedy_head_candidates: x must be a CPU float32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = stats.size(0), Kp = (K + 31) / 32 * 32;
  TORCH_CHECK(u.device().is_cpu() && u.dim() == 4 && u.is_contiguous() && u.scalar_type() == at::kChar &&
                  u.size(0) == (N + 3) / 4 && u.size(1) == Kp / 32 && u.size(2) == 4 && u.size(3) == 32,
              "greedy_head_candidates: u must be a contiguous int8 [", (N + 3) / 4, ", ", Kp / 32,
              ", 4, 32] (the head packed by tiles of 4 rows) for x's K=", K, " and stats' N=", N);
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 2 && stats.size(1) == 3,
              "greedy_head_candidates: stats must be a contiguous float32 [N, 3]");
  TORCH_CHECK(umax > 0, "greedy_head_candidates: umax must be positive");
  if (isa == kIsaAuto) isa = best_isa();
  TORCH_CHECK(isa == kIsaScalar || (isa == kIsaAvx2 && RS_HAVE_AVX2) || (isa == kIsaAvx512 && RS_GH_AVX512),
              "greedy_head_candidates: ISA path ", isa, " is not compiled into this build");
  at::Tensor counts = at::full({M}, -1, at::kLong);
  const Rows xq = quantize(x.data_ptr<float>(), x.stride(0), M, K, umax);
  if (!xq.finite || M == 0) return {at::empty({0}, at::kLong), counts};
  std::vector<float> a(M * N), b(M * N);
  const double eps = std::ldexp(1.0, -24);
  const Problem p{xq, u.data_ptr<int8_t>(), stats.data_ptr<float>(), a.data(), b.data(), M, N, K, Kp,
                  (K + 4) * eps / (1 - (K + 4) * eps) * 1.01};
  constexpr int64_t kBlock = 64;  // vocabulary rows per task (36 KB of int8 at K = 576)
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    rows(p, isa, b0 * kBlock, std::min(N, b1 * kBlock));
  });
  // Per row of x: max (A - B), then every n with A + B above it. In double, where A +- B is exact
  // (B >= 2^-22 |A|, so their exponents are close).
  std::vector<std::vector<int64_t>> found(M);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* am = a.data() + m * N;
      const float* bm = b.data() + m * N;
      double lower = -std::numeric_limits<double>::infinity();
#pragma omp simd reduction(max : lower)
      for (int64_t n = 0; n < N; ++n) lower = std::max(lower, static_cast<double>(am[n]) - bm[n]);
      for (int64_t n = 0; n < N; ++n)
        if (static_cast<double>(am[n]) + bm[n] >= lower) found[m].push_back(n);
    }
  });
  int64_t total = 0;
  for (int64_t m = 0; m < M; ++m) total += static_cast<int64_t>(found[m].size());
  at::Tensor idx = at::empty({total}, at::kLong);
  int64_t* out = idx.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    std::copy(found[m].begin(), found[m].end(), out);
    out += found[m].size();
    cnt[m] = static_cast<int64_t>(found[m].size());
  }
  return {idx, counts};
}
