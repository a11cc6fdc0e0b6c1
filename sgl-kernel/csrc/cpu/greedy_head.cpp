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
// every ||u_n||), which bounds every partial sum of |u r| (Cauchy-Schwarz again). Why int16
// activations: the built-in model's final states have one channel ~50x the others, which sets the
// row's scale; at int8 the other channels' rounding error made the bound let a large share of the
// vocabulary through (a float64 simulation while designing this, not kept), at int16 a handful
// (benchmark/bench_greedy_head.py prints the counts).
//
// Paths (`isa` forces one, for tests; all give the same integers, and so the same A, B and
// candidates): AVX-512BW (vpdpwssd with VNNI, else vpmaddwd + add), AVX2 (vpmaddwd + add), scalar.

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
  std::vector<float> c_delta, c_omega;  // the bound's factors of delta and omega (see store)
  int64_t ld = 0;
  bool proven = true;  // false: a row is not finite, or has no safe scale; nothing is proven
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
      q.proven = false;
      return q;
    }
    q.xnorm[m] = std::sqrt(ss);
    if (amax == 0.0) continue;
    // ||r|| <= R ||x|| / amax + sqrt(K) / 2 (rounding), kept under 2e9 / umax.
    const double room = (2.0e9 / umax - std::sqrt(static_cast<double>(K)) / 2) * amax / q.xnorm[m];
    const double R = std::min(32767.0, std::floor(room));
    if (R < 1.0) {
      q.proven = false;  // no safe scale: the caller scores every row exactly
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
  // gamma_K: the fp32 error of any order of summing K products, relative to sum |x w| <= ||x|| ||w||.
  const double eps = std::ldexp(1.0, -24), gamma = (K + 4) * eps / (1 - (K + 4) * eps) * 1.01;
  q.c_delta.resize(M);
  q.c_omega.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    q.c_delta[m] = static_cast<float>((1 + gamma) * q.xnorm[m] * (1 + 1e-5));
    q.c_omega[m] = static_cast<float>((q.qerr[m] + gamma * q.xnorm[m]) * (1 + 1e-5));
  }
  return q;
}

// u is packed by tiles of 4 vocabulary rows: [Np / 4][Kp / 32][4][32] (Np, Kp: N and K rounded
// up to 4 and 32, zero padded), so a tile's 4 rows are one sequential stream (4 separate row
// streams ran at a third of the memory's speed on the development machine).
constexpr int64_t kTileBytesPerStep = 4 * 32;
constexpr int64_t kAhead = 4;  // tiles between a tile's prefetch and its use
constexpr int64_t kRunsPerThread = 4;  // runs of blocks per thread on the step team (parallel_runs)
constexpr int64_t kBlock = 64;  // vocabulary rows per task (36 KB of int8 at K = 576)

struct Problem {
  const Rows& x;
  const int8_t* u;  // packed, see above
  const float* stats;  // [N, 3]: t, delta, omega
  // [M, kBlock]: A and B of one block of vocabulary rows (n0 .. n0 + kBlock), the caller's
  // scratch. Never [M, N]: at 64 rows that was 25 MB written and read back per call, for the
  // handful of entries the candidates need (they are recomputed, exactly, in their blocks).
  float* a;
  float* b;
  int64_t M, N, Kp, n0;

  const int8_t* tile_at(int64_t n) const { return u + (n / 4) * Kp * 4; }
  const int16_t* row(int64_t m) const { return x.r.data() + m * x.ld; }
};

// A and its bound B for rows m0.. m0 + MB of x against vocabulary rows n.. n + 3, from the exact
// integer sums. In fp32, rounded outward: B = (delta c_delta[m] + omega c_omega[m] + 2^-22 |A|
// + 1e-30) (1 + 2^-20), where c_delta = (1 + gamma) ||x|| and c_omega = ||x - sx r|| + gamma ||x||
// (each with a 1e-5 margin); the last factor covers the fp32 rounding of the 4 operations (and the
// 2^-22 |A| term covers A's own 3 roundings), so B is never below the real bound.
template <int MB>
inline void store(const Problem& p, int64_t m0, int64_t n, const int64_t* dot) {
  const int64_t jn = std::min<int64_t>(4, p.N - n);
  for (int i = 0; i < MB; ++i) {
    const int64_t m = m0 + i;
    const float sx = static_cast<float>(p.x.sx[m]), cd = p.x.c_delta[m], co = p.x.c_omega[m];
    float* a = p.a + m * kBlock + (n - p.n0);
    float* b = p.b + m * kBlock + (n - p.n0);
    for (int64_t j = 0; j < jn; ++j) {
      const float* st = p.stats + 3 * (n + j);
      const float av = static_cast<float>(dot[j * MB + i]) * (st[0] * sx);
      a[j] = av;
      b[j] = (st[1] * cd + st[2] * co + std::fabs(av) * 0x1p-22f + 1e-30f) * (1 + 0x1p-20f);
    }
  }
}

// The two cache lines of one step of a tile (kTileBytesPerStep = 128 bytes).
inline void prefetch_step(const int8_t* step) {
#if RS_HAVE_AVX2
  _mm_prefetch(reinterpret_cast<const char*>(step), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(step + 64), _MM_HINT_T0);
#endif
}

void tile_scalar(const Problem& p, int64_t m0, int MB, int64_t n, int64_t* out) {
  const int8_t* t = p.tile_at(n);
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) {
      const int16_t* r = p.row(m0 + i);
      int64_t s = 0;
      for (int64_t k = 0; k < p.Kp; ++k) s += static_cast<int64_t>(r[k]) * t[(k / 32) * kTileBytesPerStep + j * 32 + k % 32];
      out[j * MB + i] = s;
    }
}

#if RS_GH_AVX512
// The lane sums of 4 vectors, as [sum a0, sum a1, sum a2, sum a3]: 10 instructions where 4
// separate reductions take ~32. Wrapping int32 adds are exact here (every partial sum's true
// value is bounded as the total's is, see quantize).
inline __m128i reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  // Per 128-bit lane: [a0, a1, a2, a3] partial sums.
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The tile's 4 vocabulary rows against MB rows of x, 32 inputs per step.
template <int MB>
void tile512(const Problem& p, int64_t m0, int64_t n, int64_t* out, bool prefetch) {
  __m512i acc[4][MB];
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_si512();
  const int8_t* t = p.tile_at(n);
  const int64_t ahead = kAhead * p.Kp * 4;
  for (int64_t k = 0; k < p.Kp; k += 32, t += kTileBytesPerStep) {
    if (prefetch) prefetch_step(t + ahead);
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
  for (int i = 0; i < MB; ++i) {
    int32_t sums[4];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums), reduce4(acc[0][i], acc[1][i], acc[2][i], acc[3][i]));
    for (int j = 0; j < 4; ++j) out[j * MB + i] = sums[j];
  }
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
    if (prefetch) prefetch_step(t + ahead);
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
      out[j * MB + i] = _mm_cvtsi128_si32(s);
    }
}
#endif

template <int MB>
void tile(const Problem& p, int64_t isa, int64_t m0, int64_t n, bool prefetch) {
  int64_t dot[4 * MB];
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
  store<MB>(p, m0, n, dot);
}

// Rows of x per tile: 4 vocabulary rows x 4 rows of x, 16 accumulators. 6 rows (24 of AVX-512's
// 32 registers) ran 1.4-1.6x slower at 16 and 64 rows on Zen 4 (the compiler spilled them).
constexpr int64_t kTileRows = 4;

// The tile of `rows` (1..kTileRows) rows of x from m against vocabulary rows n.. n + 3.
void tile_any(const Problem& p, int64_t isa, int64_t rows, int64_t m, int64_t n, bool prefetch) {
  switch (rows) {
    case 4: tile<4>(p, isa, m, n, prefetch); break;
    case 3: tile<3>(p, isa, m, n, prefetch); break;
    case 2: tile<2>(p, isa, m, n, prefetch); break;
    default: tile<1>(p, isa, m, n, prefetch); break;
  }
}

// Vocabulary rows [p.n0, n1) (one block, n0 a multiple of 4) against rows [m0, m1) of x: A and B
// into p's scratch; then, per row of x, the largest A - B and A + B over them (in double, where
// both are exact: B >= 2^-22 |A| keeps their exponents close), at lower[m - m0]. Every tile shape gives each
// (row, vocabulary row) the same integer sum, so the same A and B.
void rows(const Problem& p, int64_t isa, int64_t n1, int64_t m0, int64_t m1, double* lower, double* upper) {
  for (int64_t n = p.n0; n < n1; n += 4) {
    // The first pass over a tile fetches the tile kAhead further on.
    const bool prefetch = n + 4 * (kAhead + 1) <= p.N;
    for (int64_t m = m0; m < m1; m += kTileRows)
      tile_any(p, isa, std::min(kTileRows, m1 - m), m, n, prefetch && m == m0);
  }
  for (int64_t m = m0; m < m1; ++m) {
    const float* a = p.a + m * kBlock;
    const float* b = p.b + m * kBlock;
    double lo = -std::numeric_limits<double>::infinity(), hi = lo;
    for (int64_t j = 0; j < n1 - p.n0; ++j) {
      lo = std::max(lo, static_cast<double>(a[j]) - b[j]);
      hi = std::max(hi, static_cast<double>(a[j]) + b[j]);
    }
    lower[m - m0] = lo;
    upper[m - m0] = hi;
  }
}

int64_t best_isa() { return RS_GH_AVX512 ? kIsaAvx512 : RS_HAVE_AVX2 ? kIsaAvx2 : kIsaScalar; }

}  // namespace

std::vector<std::string> greedy_head_isas() { return isa_names(RS_HAVE_AVX2, RS_GH_AVX512); }

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
  if (!xq.proven || M == 0) return {at::empty({0}, at::kLong), counts};
  Problem p{xq, u.data_ptr<int8_t>(), stats.data_ptr<float>(), nullptr, nullptr, M, N, Kp, 0};
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  std::vector<double> lower(blocks * M), upper(blocks * M);  // [block][m]
  // On the step team (its scope held from the stack's first layer, or opened here), in runs the
  // threads pull: each block's bounds are its own, so which thread scores a run changes no bit.
  const rs::StepTeam step_team;
  const int64_t threads = rs::get_num_threads();
  rs::parallel_runs(blocks, std::max<int64_t>(8, blocks / (threads * kRunsPerThread)), [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(2 * M * kBlock);  // this task's A and B, one block at a time
    Problem q = p;
    q.a = scratch.data();
    q.b = scratch.data() + M * kBlock;
    for (int64_t blk = b0; blk < b1; ++blk) {
      q.n0 = blk * kBlock;
      rows(q, isa, std::min(N, q.n0 + kBlock), 0, M, &lower[blk * M], &upper[blk * M]);
    }
  });
  // Per row of x: the largest A - B, then every n with A + B above it, looked for only in the
  // blocks whose largest A + B reaches it (a handful), their A and B computed again for that row.
  std::vector<std::vector<int64_t>> found(M);
  std::vector<float> scratch(2 * M * kBlock);
  p.a = scratch.data();
  p.b = scratch.data() + M * kBlock;
  for (int64_t m = 0; m < M; ++m) {
    double bound = -std::numeric_limits<double>::infinity();
    for (int64_t blk = 0; blk < blocks; ++blk) bound = std::max(bound, lower[blk * M + m]);
    const float* am = p.a + m * kBlock;
    const float* bm = p.b + m * kBlock;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      if (upper[blk * M + m] < bound) continue;
      p.n0 = blk * kBlock;
      const int64_t n1 = std::min(N, p.n0 + kBlock);
      double lo, hi;
      rows(p, isa, n1, m, m + 1, &lo, &hi);
      for (int64_t n = p.n0; n < n1; ++n)
        if (static_cast<double>(am[n - p.n0]) + bm[n - p.n0] >= bound) found[m].push_back(n);
    }
  }
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
