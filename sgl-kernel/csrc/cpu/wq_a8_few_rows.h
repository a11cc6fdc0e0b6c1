// One to four rows of int8 x (a decode step's tokens, one expert's few pairs) against a run of
// panels (wq_a8_panels.h): panel_tile's block dots and fp32 epilogue, op for op and in the same
// order (so the same bits), with the weight stream prefetched.
//
// Why: at one row the panel kernel is bound neither by its arithmetic nor by memory alone but by
// the two not overlapping: on Zen 4 one thread ran Q4_0 panels at ~40 GB/s from cache and at ~60%
// of a plain read of the same bytes from memory (about the sum of the two times). Prefetching the
// weights into L2 kFewRowsPrefetchBytes ahead (a thread's panels lie end to end, so past a panel's
// end that is the next one's start; never past the run) took that to ~75-80% on one thread.
// Tried and dropped (no gain measured on Zen 4, from cache or memory): VNNI int4 high nibbles
// used in place (w & 0xF0), four vpdpbusd accumulators a row; two panels a pass sharing x's
// broadcasts ran ~15% faster from cache and ~2x slower from memory (two streams 8 KB apart).
// Besides: groups walked outside their blocks (no division a block), full panels stored by one
// vector store.
#pragma once

#include "wq_a8_panels.h"

namespace wq_a8_panels {

#if RS_HAVE_AVX2
// Rows of x up to which a run of panels takes few_rows_run (more: panel_rows' 4-row tiles).
constexpr int64_t kFewRows = 4;

// How far ahead of the current block the weight stream is prefetched (into L2: software
// prefetches into L1 at this distance ran slower on Zen 4, 8-32 KB into L2 alike).
constexpr int64_t kFewRowsPrefetchBytes = 8192;

// y[m0 .. m0 + MB, the panel's rows]: panel_tile<MB, ...>'s result, bit for bit. Prefetches stop
// at `end`, the run's last weight byte.
template <int MB, bool kInt4, bool kHalf, bool kVnni>
inline void few_rows_panel(const PackedProblem& p, int64_t panel, int64_t m0, const uint8_t* end) {
  constexpr int64_t kPanelBlock = kInt4 ? 128 : 256;
  const int64_t nb = p.K / kBlock, bpg = p.blocks_per_group;
  const bool offsets = p.g.o != nullptr || p.g.zero != 0.f;
  const __m256 neg_zero = _mm256_set1_ps(-p.g.zero);
  const uint8_t* wb = p.q + panel * nb * kPanelBlock;
  const int64_t g0 = panel * p.groups * kPanel;  // this panel's first group element
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < p.groups; ++g) {
    const __m256 sw = load8<kHalf>(p.g.s, g0 + g * kPanel);
    for (int64_t last = b + bpg; b < last; ++b, wb += kPanelBlock) {
      if (wb + kFewRowsPrefetchBytes < end)
        for (int64_t at = 0; at < kPanelBlock; at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kFewRowsPrefetchBytes + at), _MM_HINT_T1);
      const int8_t* xb[MB];
      int32_t bsum[MB];
      for (int m = 0; m < MB; ++m) {
        xb[m] = p.xq->q.data() + (m0 + m) * p.K + b * kBlock;
        bsum[m] = p.xq->bsum[(m0 + m) * nb + b];
      }
      __m256i dot[MB];
      block_dots<MB, kInt4, kVnni>(wb, xb, bsum, dot);
      for (int m = 0; m < MB; ++m) {
        const __m256 sx = _mm256_set1_ps(p.xq->scale[(m0 + m) * nb + b]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(sw, sx), acc[m]);
      }
    }
    if (offsets) {
      const __m256 ow = p.g.o != nullptr ? load8<kHalf>(p.g.o, g0 + g * kPanel) : _mm256_mul_ps(sw, neg_zero);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm256_fmadd_ps(ow, _mm256_set1_ps(p.xq->gsum[(m0 + m) * p.groups + g]), acc[m]);
    }
  }
  const int64_t n0 = panel * kPanel, rows = std::min(kPanel, p.N - n0);
  for (int m = 0; m < MB; ++m) {
    float* y = p.y + (m0 + m) * p.N + n0;
    if (rows == kPanel) {
      _mm256_storeu_ps(y, p.bias != nullptr ? _mm256_add_ps(acc[m], _mm256_loadu_ps(p.bias + n0)) : acc[m]);
      continue;
    }
    alignas(32) float out[kPanel];
    _mm256_store_ps(out, acc[m]);
    for (int64_t r = 0; r < rows; ++r) y[r] = p.bias != nullptr ? out[r] + p.bias[n0 + r] : out[r];
  }
}

template <int MB, bool kInt4, bool kHalf, bool kVnni>
inline void few_rows_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0) {
  const uint8_t* end = p.q + p1 * (p.K / kBlock) * (kInt4 ? 128 : 256);
  for (int64_t panel = p0; panel < p1; ++panel) few_rows_panel<MB, kInt4, kHalf, kVnni>(p, panel, m0, end);
}

template <bool kInt4, bool kHalf, bool kVnni>
inline void few_rows_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return few_rows_run<1, kInt4, kHalf, kVnni>(p, p0, p1, m0);
    case 2: return few_rows_run<2, kInt4, kHalf, kVnni>(p, p0, p1, m0);
    case 3: return few_rows_run<3, kInt4, kHalf, kVnni>(p, p0, p1, m0);
    case 4: return few_rows_run<4, kInt4, kHalf, kVnni>(p, p0, p1, m0);
    default: break;
  }
}

template <bool kVnni>
inline void few_rows_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t rows, bool int4) {
  if (p.g.half)
    int4 ? few_rows_run<true, true, kVnni>(p, p0, p1, m0, rows) : few_rows_run<false, true, kVnni>(p, p0, p1, m0, rows);
  else
    int4 ? few_rows_run<true, false, kVnni>(p, p0, p1, m0, rows)
         : few_rows_run<false, false, kVnni>(p, p0, p1, m0, rows);
}

// Rows [m0, m1) of x against panels [p0, p1): few_rows_run's per panel up to kFewRows rows,
// panel_rows' tiles past that. isa as panel_rows'.
inline void panel_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t m1, bool int4,
                      int64_t isa) {
  if (m1 - m0 > kFewRows) {
    for (int64_t panel = p0; panel < p1; ++panel) panel_rows(p, panel, m0, m1, int4, isa);
    return;
  }
#if RS_HAVE_A8_VNNI
  if (isa == kA8IsaVnni) return few_rows_run<true>(p, p0, p1, m0, m1 - m0, int4);
#endif
  few_rows_run<false>(p, p0, p1, m0, m1 - m0, int4);
}
#endif

}  // namespace wq_a8_panels
