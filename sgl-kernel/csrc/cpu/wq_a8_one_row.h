// One row of int8 x (a decode step's token, an expert's one pair) against a run of panels
// (wq_a8_panels.h): the GEMM tiles' (wq_a8_gemm.h) exact int32 block dots and fp32 epilogue, op for
// op and in the same order (so the same bits), with the weight stream prefetched.
//
// Why: at one row the panel kernel is bound neither by its arithmetic nor by memory alone but by
// the two not overlapping: on Zen 4 one thread ran Q4_0 panels at ~40 GB/s from cache and at
// ~60-80% of a plain read of the same bytes from memory (about the sum of the two times).
// Prefetching the weights into L2 kRowPrefetchBytes ahead (a thread's panels lie end to end, so
// past a panel's end that is the next one's start; never past the run) cut the built-in model's
// one-row Q4 decoder panels by 10-30% (docs/cpu_backend.md). A run also opens with its first
// kRowPrefetchBytes (and its scales' and offsets' first bytes) requested at once, and the scales and
// offsets are prefetched ahead like the weights: a decode step is ~120 runs a thread, each of
// three streams that began cold (1-2.5% on the built-in model's 120 one-row linears, one Zen 4
// thread, A/B in one process). The prefetches cost ~20% from cache,
// so 2 rows and more, where the integer work dominates, take the GEMM tiles. Tried and dropped (no gain measured on Zen 4): VNNI int4 high nibbles used in place
// (w & 0xF0), four vpdpbusd accumulators a row; two panels a pass sharing x's broadcasts ran ~15%
// faster from cache and ~2x slower from memory (two streams 8 KB apart).
#pragma once

#include "wq_a8_panels.h"

namespace wq_a8_panels {

#if RS_HAVE_AVX2
// How far ahead of the current block the weight stream is prefetched (into L2: software
// prefetches into L1 at this distance ran slower on Zen 4, 8-32 KB into L2 alike).
constexpr int64_t kRowPrefetchBytes = 8192;

// L2 prefetches of [from, min(from + bytes, end)), one a cache line.
inline void prefetch_span(const uint8_t* from, int64_t bytes, const uint8_t* end) {
  const uint8_t* stop = std::min(from + bytes, end);
  for (const uint8_t* at = from; at < stop; at += 64) _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
}

// Bytes of one group element of the scales (and of the offsets): fp16 or fp32.
template <bool kHalf>
constexpr int64_t group_elem_bytes() {
  return kHalf ? 2 : 4;
}

// A run's streams for the panels' prefetches: where the weights, scales and offsets of the run
// end (prefetches stop there), and how far ahead the group streams are fetched (the same share of
// the run as kRowPrefetchBytes is of its weights).
struct RunStreams {
  const uint8_t* q_end;
  const uint8_t* s_end;
  const uint8_t* o_end;  // nullptr: no offsets stream
  int64_t group_ahead;
};

// y[m, the panel's rows] = acc (+ bias): a full panel in one vector store, a part-filled last one
// through a buffer.
inline void store_row(const PackedProblem& p, int64_t panel, int64_t m, __m256 acc) {
  const int64_t n0 = panel * kPanel, rows = std::min(kPanel, p.N - n0);
  float* y = p.y + m * p.N + n0;
  if (rows == kPanel) {
    _mm256_storeu_ps(y, p.bias != nullptr ? _mm256_add_ps(acc, _mm256_loadu_ps(p.bias + n0)) : acc);
    return;
  }
  alignas(32) float out[kPanel];
  _mm256_store_ps(out, acc);
  for (int64_t r = 0; r < rows; ++r) y[r] = p.bias != nullptr ? out[r] + p.bias[n0 + r] : out[r];
}

// Row m of x against one panel, groups of several blocks (y[m, the panel's rows]): the GEMM
// tile's result, bit for bit (groups walked outside their blocks: no division a block).
template <bool kInt4, bool kHalf, bool kVnni>
inline void row_panel_groups(const PackedProblem& p, int64_t panel, int64_t m, const RunStreams& run) {
  constexpr int64_t kPanelBlock = kInt4 ? 128 : 256;
  constexpr int64_t kGroupBytes = group_elem_bytes<kHalf>() * kPanel;  // one group's 8 scales
  const int64_t nb = p.K / kBlock, bpg = p.blocks_per_group;
  const bool offsets = p.g.o != nullptr || p.g.zero != 0.f;
  const __m256 neg_zero = _mm256_set1_ps(-p.g.zero);
  const uint8_t* wb = p.q + panel * nb * kPanelBlock;
  const int64_t g0 = panel * p.groups * kPanel;  // this panel's first group element
  const int8_t* xq = p.xq->q.data() + m * p.K;
  const float* xs = p.xq->scale.data() + m * nb;
  const int32_t* xbs = p.xq->bsum.data() + m * nb;
  const float* xg = p.xq->gsum.data() + m * p.groups;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < p.groups; ++g) {
    const __m256 sw = load8<kHalf>(p.g.s, g0 + g * kPanel);
    // The scales and offsets lie end to end like the weights: one prefetch a cache line (torch's
    // CPU tensors start 64-byte aligned), issued by the group that starts it.
    const int64_t ahead = (g0 + g * kPanel) * group_elem_bytes<kHalf>() + run.group_ahead;
    if (ahead % 64 < kGroupBytes) {
      const uint8_t* s_at = static_cast<const uint8_t*>(p.g.s) + ahead;
      if (s_at < run.s_end) _mm_prefetch(reinterpret_cast<const char*>(s_at), _MM_HINT_T1);
      if (run.o_end != nullptr && static_cast<const uint8_t*>(p.g.o) + ahead < run.o_end)
        _mm_prefetch(static_cast<const char*>(p.g.o) + ahead, _MM_HINT_T1);
    }
    for (int64_t last = b + bpg; b < last; ++b, wb += kPanelBlock) {
      if (wb + kRowPrefetchBytes < run.q_end)
        for (int64_t at = 0; at < kPanelBlock; at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kRowPrefetchBytes + at), _MM_HINT_T1);
      const __m256i dot = row_block_dot<kInt4, kVnni>(wb, xq + b * kBlock, xbs[b]);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(xs[b])), acc);
    }
    if (offsets) {
      const __m256 ow = p.g.o != nullptr ? load8<kHalf>(p.g.o, g0 + g * kPanel) : _mm256_mul_ps(sw, neg_zero);
      acc = _mm256_fmadd_ps(ow, _mm256_set1_ps(xg[g]), acc);
    }
  }
  store_row(p, panel, m, acc);
}

// Row m of x against one panel whose groups are one block each (GGUF's Q4_0, Q4_1, Q8_0): the
// same operations on each output as row_panel_groups (so the same bits) in one flat loop, the
// offsets' form fixed at compile time (kOff: 0 none, 1 a zero point, 2 stored), and the
// prefetches in a first part of the loop that ends where they would pass the run's end (the rest
// goes without) instead of a test a block. row_panel_groups' group loop (branches, a 64-bit
// remainder, reloads through p) ran once a block here; this loop: Q4_0 / Q4_1 one-row products
// ~1.3x and Q8_0 ~1.15x faster from cache on one Zen 3 thread (bench_wq_a8_tiles.py --tokens 1
// --copies 1, docs/cpu_backend.md).
template <int kOff, bool kInt4, bool kHalf, bool kVnni>
inline void row_panel_blocks(const PackedProblem& p, int64_t panel, int64_t m, const RunStreams& run) {
  constexpr int64_t kPanelBlock = kInt4 ? 128 : 256;
  constexpr int64_t kGroupBytes = group_elem_bytes<kHalf>() * kPanel;
  const int64_t nb = p.K / kBlock;
  const uint8_t* wb = p.q + panel * nb * kPanelBlock;
  const int64_t g0 = panel * nb * kPanel;  // this panel's first group element
  const uint8_t* s_at = static_cast<const uint8_t*>(p.g.s) + g0 * group_elem_bytes<kHalf>();
  const uint8_t* o_at = kOff == 2 ? static_cast<const uint8_t*>(p.g.o) + g0 * group_elem_bytes<kHalf>() : nullptr;
  const int8_t* xq = p.xq->q.data() + m * p.K;
  const float* xs = p.xq->scale.data() + m * nb;
  const int32_t* xbs = p.xq->bsum.data() + m * nb;
  const float* xg = p.xq->gsum.data() + m * nb;
  const __m256 neg_zero = _mm256_set1_ps(-p.g.zero);
  // The blocks whose weight prefetch stays inside the run (the group streams' distance is the
  // same share of theirs, so theirs end about there too).
  const int64_t prefetched = std::clamp<int64_t>((run.q_end - wb - kRowPrefetchBytes) / kPanelBlock, 0, nb);
  __m256 acc = _mm256_setzero_ps();
  auto block = [&](int64_t b, auto prefetch) {
    if constexpr (decltype(prefetch)::value) {
      for (int64_t at = 0; at < kPanelBlock; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kRowPrefetchBytes + at), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(s_at + run.group_ahead), _MM_HINT_T1);
      if constexpr (kOff == 2) _mm_prefetch(reinterpret_cast<const char*>(o_at + run.group_ahead), _MM_HINT_T1);
    }
    const __m256i dot = row_block_dot<kInt4, kVnni>(wb, xq + b * kBlock, xbs[b]);
    const __m256 sw = kHalf ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s_at)))
                            : _mm256_loadu_ps(reinterpret_cast<const float*>(s_at));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(xs[b])), acc);
    if constexpr (kOff == 1) acc = _mm256_fmadd_ps(_mm256_mul_ps(sw, neg_zero), _mm256_set1_ps(xg[b]), acc);
    if constexpr (kOff == 2) {
      const __m256 ow = kHalf ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o_at)))
                              : _mm256_loadu_ps(reinterpret_cast<const float*>(o_at));
      acc = _mm256_fmadd_ps(ow, _mm256_set1_ps(xg[b]), acc);
      o_at += kGroupBytes;
    }
    wb += kPanelBlock;
    s_at += kGroupBytes;
  };
  int64_t b = 0;
  for (; b < prefetched; ++b) block(b, std::true_type{});
  for (; b < nb; ++b) block(b, std::false_type{});
  store_row(p, panel, m, acc);
}

// Row m of x against panels [p0, p1).
template <bool kInt4, bool kHalf, bool kVnni>
inline void row_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m) {
  constexpr int64_t kPanelBlock = kInt4 ? 128 : 256;
  const int64_t nb = p.K / kBlock;
  const uint8_t* q0 = p.q + p0 * nb * kPanelBlock;
  const uint8_t* end = p.q + p1 * nb * kPanelBlock;
  // The run's first kRowPrefetchBytes, and its groups' first bytes, requested at once: the panels
  // prefetch only ahead of the block they read, so a run (each linear's share of a thread) began
  // on demand misses and the hardware prefetcher's ramp, on three streams (weights, scales,
  // offsets). Many lines in flight at the start is what a cold run lacks.
  prefetch_span(q0, kRowPrefetchBytes, end);
  const int64_t group_bytes = group_elem_bytes<kHalf>() * kPanel * p.groups;  // one panel's scales
  const int64_t ahead = kRowPrefetchBytes * group_bytes / (nb * kPanelBlock);  // the same share of the run
  const uint8_t* s = static_cast<const uint8_t*>(p.g.s);
  const uint8_t* o = static_cast<const uint8_t*>(p.g.o);
  prefetch_span(s + p0 * group_bytes, ahead, s + p1 * group_bytes);
  if (o != nullptr) prefetch_span(o + p0 * group_bytes, ahead, o + p1 * group_bytes);
  const RunStreams run{end, s + p1 * group_bytes, o != nullptr ? o + p1 * group_bytes : nullptr, ahead};
  if (p.blocks_per_group != 1) {
    for (int64_t panel = p0; panel < p1; ++panel) row_panel_groups<kInt4, kHalf, kVnni>(p, panel, m, run);
    return;
  }
  const int off = o != nullptr ? 2 : p.g.zero != 0.f ? 1 : 0;
  for (int64_t panel = p0; panel < p1; ++panel) {
    if (off == 2)
      row_panel_blocks<2, kInt4, kHalf, kVnni>(p, panel, m, run);
    else if (off == 1)
      row_panel_blocks<1, kInt4, kHalf, kVnni>(p, panel, m, run);
    else
      row_panel_blocks<0, kInt4, kHalf, kVnni>(p, panel, m, run);
  }
}

template <bool kVnni>
inline void one_row_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m, bool int4) {
  if (p.g.half)
    int4 ? row_run<true, true, kVnni>(p, p0, p1, m) : row_run<false, true, kVnni>(p, p0, p1, m);
  else
    int4 ? row_run<true, false, kVnni>(p, p0, p1, m) : row_run<false, false, kVnni>(p, p0, p1, m);
}

// Row m of x against panels [p0, p1). isa: kA8IsaAvx2 or kA8IsaVnni (a8_resolve_isa's, so a
// VNNI isa is compiled in).
inline void one_row_run(const PackedProblem& p, int64_t p0, int64_t p1, int64_t m, bool int4, int64_t isa) {
#if RS_HAVE_A8_VNNI
  if (isa == kA8IsaVnni) return one_row_run<true>(p, p0, p1, m, int4);
#endif
  (void)isa;
  one_row_run<false>(p, p0, p1, m, int4);
}
#endif

}  // namespace wq_a8_panels
