// The batched (GEMM) form of the int8-activation panel kernels (wq_a8_panels.h): the same
// pack_wq_a8 panels, the same quantized x, the same per-element arithmetic, register-blocked for
// batches of many rows (decode steps at concurrency 16-64, prefill chunks).
//
// Why: wq_a8_panels' tile holds 4 rows of x against one panel of 8 output rows, so each chunk's
// x bytes are broadcast once per panel and each panel's nibbles unpacked once per 4 rows. Here a
// tile is MB rows of x against NP panels (MB x NP int32 dot registers, MB x NP fp32
// accumulators): each x broadcast feeds NP vpdpbusd, each unpacked chunk MB, and the rows are
// cut in chunks of kRowChunk so a thread's run of panels is swept once per chunk with that
// chunk's quantized x hot in L2 (prefill's thousands of rows would otherwise stream x from
// memory once per panel pair). With 32 ymm registers (AVX512VL) a 6 x 2 tile of 8-bit weights
// fits without spills; 4-bit weights take 5 x 2 (kTileRows). AVX2 CPUs (no vpdpbusd) run the
// same tiles on the panel kernel's vpmaddubsw sums, 4 x 2 (16 ymm registers).
//
// Numerics: per output element, the block's exact int32 dot (vpdpbusd; integer sums in any order
// are the same int32), then acc = fma(float(dot), s_w * s_x, acc) block by block and the group's
// offset term fma(o_w, gsum, acc) at its last block, then + bias: the panel kernel's operations
// in its order, so the same bits whatever tile or chunk a row falls in (test_wq_a8_gemm.py).
// quantize_blocks_parallel makes quantize_blocks' bytes (the same fp32 operations, vectorized
// and spread over threads).
#pragma once

#include <atomic>

#include "common.h"
#include "linear_wq_a8_quant.h"
#include "wq_a8_panels.h"

namespace wq_a8_gemm {

using wq_a8_panels::kPanel;
using wq_a8_panels::PackedProblem;

// Products of at least this many rows take the GEMM tiles (one row: the one-row work). Both give
// the same bits, so the bound is speed only: on Zen 4 (one thread, thread CPU time, in-process
// alternation, weights in cache) the tiles ran 1.2-1.4x the panel kernel's 4-row tiles at 2, 3
// and 4 rows (built-in model's Q4_1 / Q8_0 decoder shapes, Qwen3-30B-A3B's Q4_0 experts), and
// 1.1-1.6x with the weights streaming from memory (the tiles prefetch the next panels).
constexpr int64_t kMinRows = 2;
// Rows of x per sweep of a thread's panels: 128 rows of the widest K here (1536) are 192 KB of
// int8 x, inside Zen 4's 1 MB L2 beside the panels.
constexpr int64_t kRowChunk = 128;
// x of at most this many elements is quantized on the calling thread: a decode batch's x (16 x
// 576 is ~2 us of work) cost more in a parallel region's start, which wakes a sleeping worker
// (the server's OpenMP workers sleep after 10 us: utils/cpus.py), than the quantization itself.
constexpr int64_t kInlineQuantElems = int64_t{1} << 16;
// Tasks per thread when the threads pull their work (parallel_chunks): enough that a thread that
// starts late or is preempted leaves at most an eighth of its share to the join.
constexpr int64_t kTasksPerThread = 8;

// f(t0, t1) over [0, n) in runs of `chunk`, each thread taking the next run from an atomic counter
// when it finishes one, instead of at::parallel_for's fixed halves: on a 2-core server the other
// processes (HTTP, tokenizer, detokenizer) preempt one thread now and then, and a worker woken
// late starts its fixed half late; either way the join waited for that thread's whole share while
// the other core idled. Which thread computes a run never changes its bits (each output is one
// thread's, in the same order).
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  const int64_t tasks = (n + chunk - 1) / chunk;
  if (tasks <= 1) {
    if (n > 0) f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  rs::parallel_for(0, std::min<int64_t>(rs::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
         t = next.fetch_add(1, std::memory_order_relaxed))
      f(t * chunk, std::min(n, (t + 1) * chunk));
  });
}

// The run length for parallel_chunks over n items whose runs should not be shorter than `grain`.
inline int64_t chunk_for(int64_t n, int64_t grain) {
  const int64_t per_task = (n + kTasksPerThread * rs::get_num_threads() - 1) / (kTasksPerThread * rs::get_num_threads());
  return std::max<int64_t>({int64_t{1}, grain, per_task});
}

#if RS_HAVE_AVX2
using wq_a8_panels::bcast4;

// y[m0 .. m0 + MB, the NP panels' rows] = acc (+ bias): a full panel in one vector store (and one
// vector add of the bias: the same fp32 sums as one at a time), a part-filled last one through a
// buffer. The scalar loop for every panel was 80-96 scalar stores (and bias loads) a tile.
template <int MB, int NP>
inline void store_rows(const PackedProblem& p, int64_t panel, int64_t m0, const __m256 (&acc)[MB][NP]) {
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (panel + j) * kPanel, rows = std::min(kPanel, p.N - n0);
    const bool full = rows == kPanel;
    const __m256 bias = full && p.bias != nullptr ? _mm256_loadu_ps(p.bias + n0) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      float* y = p.y + (m0 + m) * p.N + n0;
      if (full) {
        _mm256_storeu_ps(y, p.bias != nullptr ? _mm256_add_ps(acc[m][j], bias) : acc[m][j]);
        continue;
      }
      alignas(32) float out[kPanel];
      _mm256_store_ps(out, acc[m][j]);
      for (int64_t r = 0; r < rows; ++r) y[r] = p.bias != nullptr ? out[r] + p.bias[n0 + r] : out[r];
    }
  }
}

// The block's exact int32 dots of MB rows of x (xb: each row's block) against NP panels (wb:
// each panel's block): dot[m][j], one lane per panel row. VNNI: vpdpbusd (int8 weights read as
// w + 128, each lane starting at -128 * the row's block sum bsum[m]). AVX2 (no vpdpbusd): the panel
// kernel's sums (wq_a8_panels::row_block_dot_avx2): int4 adds a block's 8 vpmaddubsw in int16 before
// one vpmaddwd, int8 widens each chunk's |w| * (x * sign(w)) pairs at once. The same int32s either
// way, so the same bits.
template <int MB, int NP, bool kInt4, bool kVnni>
inline void tile_dots(const uint8_t* const* wb, const int8_t* const* xb, const int32_t* bsum, __m256i (&dot)[MB][NP]) {
  constexpr int kChunks = kInt4 ? 4 : 8;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (kInt4) {
    __m256i sum[MB][NP];  // VNNI: the int32 dots; AVX2: int16 sums (at most 30480 a lane)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NP; ++j) sum[m][j] = _mm256_setzero_si256();
    for (int c = 0; c < kChunks; ++c) {
      __m256i lo[NP], hi[NP];
      for (int j = 0; j < NP; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + 32 * c));
        lo[j] = _mm256_and_si256(raw, low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xl = bcast4(xb[m] + 8 * c), xh = bcast4(xb[m] + 8 * c + 4);
        for (int j = 0; j < NP; ++j) {
#if RS_HAVE_A8_VNNI
          if constexpr (kVnni) {
            sum[m][j] = _mm256_dpbusd_epi32(sum[m][j], lo[j], xl);
            sum[m][j] = _mm256_dpbusd_epi32(sum[m][j], hi[j], xh);
            continue;
          }
#endif
          sum[m][j] = _mm256_add_epi16(sum[m][j], _mm256_maddubs_epi16(lo[j], xl));
          sum[m][j] = _mm256_add_epi16(sum[m][j], _mm256_maddubs_epi16(hi[j], xh));
          wq_a8_panels::keep_in_register(sum[m][j]);  // in order, in a register
        }
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NP; ++j) dot[m][j] = kVnni ? sum[m][j] : _mm256_madd_epi16(sum[m][j], ones);
  } else {
    for (int m = 0; m < MB; ++m) {
      const __m256i start = kVnni ? _mm256_set1_epi32(-128 * bsum[m]) : _mm256_setzero_si256();
      for (int j = 0; j < NP; ++j) dot[m][j] = start;
    }
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < kChunks; ++c) {
      __m256i w[NP], aw[NP];
      for (int j = 0; j < NP; ++j) {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + 32 * c));
        aw[j] = kVnni ? _mm256_xor_si256(w[j], flip) : _mm256_sign_epi8(w[j], w[j]);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = bcast4(xb[m] + 4 * c);
        for (int j = 0; j < NP; ++j) {
#if RS_HAVE_A8_VNNI
          if constexpr (kVnni) {
            dot[m][j] = _mm256_dpbusd_epi32(dot[m][j], aw[j], xv);
            continue;
          }
#endif
          const __m256i pairs = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, w[j]));
          dot[m][j] = _mm256_add_epi32(dot[m][j], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  }
}

// MB rows of x (from m0) against NP consecutive panels (from panel): y[m0 .. m0 + MB, the
// panels' rows] (tile_dots on the kVnni or the AVX2 path). kPrefetch: each block of the NP panels
// also prefetches (into L2) the same block of the NP panels after them, so one tile's pass covers
// the next tile's weights; none at or past `end` (the run's last byte).
template <int MB, int NP, bool kInt4, bool kHalf, bool kVnni, bool kPrefetch = false>
inline void gemm_tile(const PackedProblem& p, int64_t panel, int64_t m0, const uint8_t* end = nullptr) {
  constexpr int64_t kChunks = kInt4 ? 4 : 8, kPanelBlock = kChunks * 32;
  const int64_t nb = p.K / kBlock, bpg = p.blocks_per_group;
  const bool offsets = p.g.o != nullptr || p.g.zero != 0.f;
  const __m256 neg_zero = _mm256_set1_ps(-p.g.zero);
  const uint8_t* wq[NP];
  int64_t g0[NP];
  for (int j = 0; j < NP; ++j) {
    wq[j] = p.q + (panel + j) * nb * kPanelBlock;
    g0[j] = (panel + j) * p.groups * kPanel;
  }
  const int8_t* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = p.xq->q.data() + (m0 + m) * p.K;
  __m256 acc[MB][NP];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm256_setzero_ps();
  // g: the block's group, counted along (b / bpg was a 64-bit idiv a block).
  for (int64_t b = 0, g = 0, in_group = 0; b < nb; ++b) {
    if constexpr (kPrefetch) {
      for (int j = 0; j < NP; ++j) {
        const uint8_t* ahead = wq[j] + b * kPanelBlock + NP * nb * kPanelBlock;
        if (ahead < end)
          for (int64_t at = 0; at < kPanelBlock; at += 64)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T1);
      }
    }
    const uint8_t* wb[NP];
    for (int j = 0; j < NP; ++j) wb[j] = wq[j] + b * kPanelBlock;
    const int8_t* xb[MB];
    int32_t bsum[MB];
    for (int m = 0; m < MB; ++m) {
      xb[m] = xrow[m] + b * kBlock;
      bsum[m] = kInt4 || !kVnni ? 0 : p.xq->bsum[(m0 + m) * nb + b];
    }
    __m256i dot[MB][NP];
    tile_dots<MB, NP, kInt4, kVnni>(wb, xb, bsum, dot);
    __m256 sw[NP];
    for (int j = 0; j < NP; ++j) sw[j] = wq_a8_panels::load8<kHalf>(p.g.s, g0[j] + g * kPanel);
    for (int m = 0; m < MB; ++m) {
      const __m256 sx = _mm256_set1_ps(p.xq->scale[(m0 + m) * nb + b]);
      for (int j = 0; j < NP; ++j)
        acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][j]), _mm256_mul_ps(sw[j], sx), acc[m][j]);
    }
    if (++in_group == bpg) {
      if (offsets) {
        // As the panel kernel: the group's offsets (stored, or -zero * scale) times x's group sum.
        for (int j = 0; j < NP; ++j) {
          const __m256 ow = p.g.o != nullptr ? wq_a8_panels::load8<kHalf>(p.g.o, g0[j] + g * kPanel)
                                             : _mm256_mul_ps(sw[j], neg_zero);
          for (int m = 0; m < MB; ++m)
            acc[m][j] = _mm256_fmadd_ps(ow, _mm256_set1_ps(p.xq->gsum[(m0 + m) * p.groups + g]), acc[m][j]);
        }
      }
      ++g;
      in_group = 0;
    }
  }
  store_rows<MB, NP>(p, panel, m0, acc);
}

// One tile of `rows` (1..kMB) rows from m (kPrefetch: gemm_tile's prefetch up to `end`).
template <int kMB, int NP, bool kInt4, bool kHalf, bool kVnni, bool kPrefetch>
inline void gemm_tile_rows(const PackedProblem& p, int64_t panel, int64_t m, int64_t rows, const uint8_t* end) {
  switch (rows) {
    case 6: if constexpr (kMB >= 6) gemm_tile<6, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    case 5: if constexpr (kMB >= 5) gemm_tile<5, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    case 4: if constexpr (kMB >= 4) gemm_tile<4, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    case 3: if constexpr (kMB >= 3) gemm_tile<3, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    case 2: gemm_tile<2, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    case 1: gemm_tile<1, NP, kInt4, kHalf, kVnni, kPrefetch>(p, panel, m, end); break;
    default: break;
  }
}

// Rows [m0, m1) against NP panels from `panel`, in as few tiles of at most kMB rows as fit, their
// sizes differing by at most one (8 rows: 4 + 4, not 6 + 2: a tile of few rows unpacks each
// weight for little work; an expert's 5-16 rows of a prefill are mostly such remainders).
// end != nullptr: the first tile prefetches the next NP panels' weights (gemm_tile), up to end.
template <int kMB, int NP, bool kInt4, bool kHalf, bool kVnni>
inline void gemm_rows_np(const PackedProblem& p, int64_t panel, int64_t m0, int64_t m1, const uint8_t* end) {
  const int64_t rows = m1 - m0, tiles = (rows + kMB - 1) / kMB;
  for (int64_t t = 0, m = m0; t < tiles; ++t) {
    const int64_t n = rows / tiles + (t < rows % tiles ? 1 : 0);
    if (t == 0 && end != nullptr)
      gemm_tile_rows<kMB, NP, kInt4, kHalf, kVnni, true>(p, panel, m, n, end);
    else
      gemm_tile_rows<kMB, NP, kInt4, kHalf, kVnni, false>(p, panel, m, n, nullptr);
    m += n;
  }
}

// Rows of x per tile, against 2 panels. VNNI (32 ymm registers): 4-bit weights take 5 (their
// unpacked low and high nibbles are 4 more live registers: 6 rows' 12 dot + 12 accumulator
// registers then left too few and the compiler spilled; one thread on Zen 4, the built-in model's
// Q4_1 layers: 64 rows 59 vs 64-67 ms a pass, 512 rows 423-455 vs 479-489, 16 rows 20.7 vs 20.3),
// 8-bit ones 6 (5 ran 0-10% slower). AVX2 (16 ymm registers, int16 sums kept in registers by
// keep_in_register): 4 x 2 for both, measured on Zen 3 (one thread, bench_wq_a8_tiles.py --isa
// avx2, G MAC/s at 16 / 128 rows): Q4_1 4x2 76-78 / 78-81, 3x2 70-72 / 72-74, 4x1 53-55 / 54-56,
// 2x2 66-67 / 67-69, 2x3 58-69 / 44-70; Q8_0 4x2 52-53 / 55, 3x2 51-53 / 54, 4x1 50-51 / 51-52;
// 5 x 2 and 4 x 3 were no faster.
template <bool kInt4, bool kVnni>
constexpr int kTileRows = kVnni ? (kInt4 ? 5 : 6) : 4;
constexpr int kTilePanels = 2;

// Panels [p0, p1) for rows [m0, m1): the rows in chunks of kRowChunk, each chunk swept over the
// panels kTilePanels at a time (the last ones one at a time). prefetch: each pass also prefetches
// the next panels' weights, never past p1 (for runs whose few rows leave the weight stream from
// memory uncovered by the arithmetic: a prefill's 5-16 rows an expert).
template <bool kInt4, bool kHalf, bool kVnni>
inline void gemm_block(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t m1, bool prefetch) {
  constexpr int kRows = kTileRows<kInt4, kVnni>, kPanels = kTilePanels;
  const uint8_t* end = prefetch ? p.q + p1 * (p.K / kBlock) * (kInt4 ? 128 : 256) : nullptr;
  for (int64_t c0 = m0; c0 < m1; c0 += kRowChunk) {
    const int64_t c1 = std::min(m1, c0 + kRowChunk);
    int64_t panel = p0;
    if constexpr (kPanels > 1)
      for (; panel + kPanels <= p1; panel += kPanels)
        gemm_rows_np<kRows, kPanels, kInt4, kHalf, kVnni>(p, panel, c0, c1, end);
    for (; panel < p1; ++panel) gemm_rows_np<kRows, 1, kInt4, kHalf, kVnni>(p, panel, c0, c1, end);
  }
}

template <bool kVnni>
inline void gemm_block(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t m1, bool int4,
                       bool prefetch) {
  if (p.g.half)
    int4 ? gemm_block<true, true, kVnni>(p, p0, p1, m0, m1, prefetch)
         : gemm_block<false, true, kVnni>(p, p0, p1, m0, m1, prefetch);
  else
    int4 ? gemm_block<true, false, kVnni>(p, p0, p1, m0, m1, prefetch)
         : gemm_block<false, false, kVnni>(p, p0, p1, m0, m1, prefetch);
}

// isa: kA8IsaAvx2 or kA8IsaVnni (a8_resolve_isa's, so a VNNI isa is compiled in).
inline void gemm_block(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t m1, bool int4,
                       int64_t isa, bool prefetch = false) {
#if RS_HAVE_A8_VNNI
  if (isa == kA8IsaVnni) return gemm_block<true>(p, p0, p1, m0, m1, int4, prefetch);
#endif
  (void)isa;
  gemm_block<false>(p, p0, p1, m0, m1, int4, prefetch);
}
// quantize_blocks' bytes for the panel orders (kNatural, kNibbleChunks), vectorized and spread
// over threads by rows: the same fp32 product x * (127 / amax), rounded half to even
// (vroundps in the default rounding mode is nearbyint), clamped, and the same scale, bsum and
// gsum (summed block by block in order). A batch of hundreds of rows otherwise spends more in the
// scalar quantizer, on one thread, than in the product.
inline void quantize_rows_simd(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t group_size,
                               A8Order order, BlockQuantRows& r) {
  const int64_t nb = K / kBlock, bpg = group_size / kBlock, groups = nb / bpg;
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(127.f), neg_lim = _mm256_set1_ps(-127.f);
  const __m256i to_natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // Per 8 inputs: the 4 even ones, then the 4 odd ones (a8_position's kNibbleChunks).
  const __m256i nibble_chunks = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4, 6, 1,
                                                 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * ldx + b * kBlock;
      __m256 v[4], amax8 = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax8);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax8);
      float amax = 0.f;
      for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]);
      const float inv_s = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 inv = _mm256_set1_ps(inv_s);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(neg_lim, t)));
      }
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum4);
      int32_t s = 0;
      for (int i = 0; i < 8; ++i) s += sums[i];
      __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), to_natural);
      if (order == A8Order::kNibbleChunks) bytes = _mm256_shuffle_epi8(bytes, nibble_chunks);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + m * K + b * kBlock), bytes);
      r.scale[m * nb + b] = amax / 127.f;
      r.bsum[m * nb + b] = s;
      r.gsum[m * groups + b / bpg] += r.scale[m * nb + b] * static_cast<float>(s);
    }
}

// quantize_blocks(x, ldx, M, K, group_size, order) for order kNatural or kNibbleChunks.
inline BlockQuantRows quantize_blocks_parallel(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group_size,
                                               A8Order order) {
  const int64_t nb = K / kBlock, bpg = group_size / kBlock;
  BlockQuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * (nb / bpg), 0.f),
                   std::vector<int32_t>(M * nb)};
  // Runs of at least kInlineQuantElems elements a thread (at::parallel_for runs inline below that).
  rs::parallel_for(0, M, std::max<int64_t>(1, kInlineQuantElems / K), [&](int64_t m0, int64_t m1) {
    quantize_rows_simd(x, ldx, m0, m1, K, group_size, order, r);
  });
  return r;
}
#endif

// Whether the GEMM tiles serve a product of `rows` rows on path `isa` (a8_resolve_isa's).
inline bool serves(int64_t rows, int64_t isa) {
  return RS_HAVE_AVX2 && (isa == kA8IsaVnni || isa == kA8IsaAvx2) && rows >= kMinRows;
}

}  // namespace wq_a8_gemm
