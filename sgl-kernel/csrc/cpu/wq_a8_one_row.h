// One row of int8 x (a decode step's token, an expert's one pair) against a run of panels
// (wq_a8_panels.h): panel_tile's block dots and fp32 epilogue, op for op and in the same order (so
// the same bits), with the weight stream prefetched.
//
// Why: at one row the panel kernel is bound neither by its arithmetic nor by memory alone but by
// the two not overlapping: on Zen 4 one thread ran Q4_0 panels at ~40 GB/s from cache and at
// ~60-80% of a plain read of the same bytes from memory (about the sum of the two times).
// Prefetching the weights into L2 kRowPrefetchBytes ahead (a thread's panels lie end to end, so
// past a panel's end that is the next one's start; never past the run) cut the built-in model's
// one-row Q4 decoder panels by 10-30% (docs/cpu_backend.md). The prefetches cost ~20% from cache,
// so 2-4 rows, where the integer work dominates, stay on panel_tile (this path at 4 rows: 10-16%
// slower). Tried and dropped (no gain measured on Zen 4): VNNI int4 high nibbles used in place
// (w & 0xF0), four vpdpbusd accumulators a row; two panels a pass sharing x's broadcasts ran ~15%
// faster from cache and ~2x slower from memory (two streams 8 KB apart).
#pragma once

#include "wq_a8_panels.h"

namespace wq_a8_panels {

#if RS_HAVE_AVX2
// How far ahead of the current block the weight stream is prefetched (into L2: software
// prefetches into L1 at this distance ran slower on Zen 4, 8-32 KB into L2 alike).
constexpr int64_t kRowPrefetchBytes = 8192;

// y[m0 .. m0 + MB, the panel's rows]: panel_tile<MB, ...>'s result, bit for bit (groups walked
// outside their blocks: no division a block). Prefetches stop at `end`, the run's last byte.
template <int MB, bool kInt4, bool kHalf, bool kVnni>
inline void rows_panel(const PackedProblem& p, int64_t panel, int64_t m0, const uint8_t* end) {
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
      if (wb + kRowPrefetchBytes < end)
        for (int64_t at = 0; at < kPanelBlock; at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kRowPrefetchBytes + at), _MM_HINT_T1);
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
inline void rows_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0) {
  const uint8_t* end = p.q + p1 * (p.K / kBlock) * (kInt4 ? 128 : 256);
  for (int64_t panel = p0; panel < p1; ++panel) rows_panel<MB, kInt4, kHalf, kVnni>(p, panel, m0, end);
}

template <bool kVnni>
inline void one_row_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m, bool int4) {
  if (p.g.half)
    int4 ? rows_run<1, true, true, kVnni>(p, p0, p1, m) : rows_run<1, false, true, kVnni>(p, p0, p1, m);
  else
    int4 ? rows_run<1, true, false, kVnni>(p, p0, p1, m) : rows_run<1, false, false, kVnni>(p, p0, p1, m);
}

// Rows [m0, m1) of x against panels [p0, p1): one row by one_row_run, more by panel_rows' tiles.
// isa as panel_rows'.
inline void panel_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m0, int64_t m1, bool int4,
                      int64_t isa) {
  if (m1 - m0 != 1) {
    for (int64_t panel = p0; panel < p1; ++panel) panel_rows(p, panel, m0, m1, int4, isa);
    return;
  }
#if RS_HAVE_A8_VNNI
  if (isa == kA8IsaVnni) return one_row_run<true>(p, p0, p1, m0, int4);
#endif
  one_row_run<false>(p, p0, p1, m0, int4);
}
#endif

}  // namespace wq_a8_panels
