// One to four rows of int8 x (a decode step's tokens, one expert's few pairs) against a run of
// panels (wq_a8_panels.h): the same int32 block dots and the same fp32 epilogue as
// panel_tile<MB, ...>, so the same bits, with the weight stream prefetched and fewer
// instructions a weight.
//
// Why: at one row the panel kernel is not bound by its arithmetic but by the two not
// overlapping: on Zen 4 one thread ran Q4_0 panels at ~45 GB/s from cache and ~60% of a plain
// read of the same bytes from memory (the sum of the two times, not the larger), Q8_0 likewise. So:
// - the weight stream is prefetched into L2 kRow1PrefetchBytes ahead (a thread's panels lie end
//   to end, so past a panel's end that is the next one's start), within the run only;
// - VNNI int4: the high nibbles are used in place (w & 0xF0 = 16 q), so a 32-byte chunk costs two
//   ands and no shift; their dots come out 16x and one exact arithmetic shift a block takes that
//   back (|16 * dot| <= 16 * 16 * 15 * 127 < 2^31);
// - four vpdpbusd accumulators a row (2-deep chains), summed in int32: exact, so the same dots;
// - groups walked outside their blocks (no division), full panels stored by one vector store.
// Two panels a pass (sharing x's broadcasts) ran faster from cache and ~2x slower from memory
// (two streams 8 KB apart), so it is one panel at a time.
// The fp32 work per block (convert, scale product, FMA; the offsets' FMA per group) is
// panel_tile's, op for op and in the same order, so every lane rounds as it did.
#pragma once

#include "wq_a8_panels.h"

namespace wq_a8_panels {

#if RS_HAVE_AVX2
// Rows of x up to which a run of panels takes few_rows_run (more: panel_rows' 4-row tiles).
constexpr int64_t kFewRows = 4;

// How far ahead of the current block the weight stream is prefetched (into L2: software
// prefetches into L1 at this distance ran slower on Zen 4, 8-32 KB into L2 alike).
constexpr int64_t kRow1PrefetchBytes = 8192;

// The block's int32 dots (one lane per panel row) of MB rows of x (xb[m]: row m's block) against
// one panel's block wb: panel_tile's dots exactly (integer sums in another order).
template <int MB, bool kInt4, bool kVnni>
inline void few_rows_dots(const uint8_t* wb, const int8_t* const* xb, const int32_t* bsum, __m256i* dot) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#if RS_HAVE_A8_VNNI
  if constexpr (kVnni && kInt4) {
    const __m256i high4 = _mm256_set1_epi8(static_cast<char>(0xF0));
    __m256i lo[MB][2], hi[MB][2];
    for (int m = 0; m < MB; ++m) lo[m][0] = lo[m][1] = hi[m][0] = hi[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      const __m256i wl = _mm256_and_si256(raw, low4), wh = _mm256_and_si256(raw, high4);
      for (int m = 0; m < MB; ++m) {
        lo[m][c & 1] = _mm256_dpbusd_epi32(lo[m][c & 1], wl, bcast4(xb[m] + 8 * c));
        hi[m][c & 1] = _mm256_dpbusd_epi32(hi[m][c & 1], wh, bcast4(xb[m] + 8 * c + 4));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256i hi16 = _mm256_add_epi32(hi[m][0], hi[m][1]);  // 16 x the high nibbles' dot
      dot[m] = _mm256_add_epi32(_mm256_add_epi32(lo[m][0], lo[m][1]), _mm256_srai_epi32(hi16, 4));
    }
    return;
  }
  if constexpr (kVnni && !kInt4) {
    // w + 128 against x, each lane from -128 * sum(x) (block_dots_vnni's correction).
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i d[MB][4];
    for (int m = 0; m < MB; ++m) {
      d[m][0] = _mm256_set1_epi32(-128 * bsum[m]);
      d[m][1] = d[m][2] = d[m][3] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c)), flip);
      for (int m = 0; m < MB; ++m) d[m][c & 3] = _mm256_dpbusd_epi32(d[m][c & 3], w, bcast4(xb[m] + 4 * c));
    }
    for (int m = 0; m < MB; ++m)
      dot[m] = _mm256_add_epi32(_mm256_add_epi32(d[m][0], d[m][1]), _mm256_add_epi32(d[m][2], d[m][3]));
    return;
  }
#endif
  (void)bsum;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kInt4) {
    // panel_tile's AVX2 int4 sums: 8 vpmaddubsw a row added in int16, then one vpmaddwd.
    __m256i s16[MB];
    for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MB; ++m) {
        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(lo, bcast4(xb[m] + 8 * c)));
        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(hi, bcast4(xb[m] + 8 * c + 4)));
      }
    }
    for (int m = 0; m < MB; ++m) dot[m] = _mm256_madd_epi16(s16[m], ones);
  } else {
    for (int m = 0; m < MB; ++m) dot[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MB; ++m) {
        const __m256i sx = _mm256_sign_epi8(bcast4(xb[m] + 4 * c), w);
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
      }
    }
  }
}

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
      if (wb + kRow1PrefetchBytes < end)
        for (int64_t at = 0; at < kPanelBlock; at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kRow1PrefetchBytes + at), _MM_HINT_T1);
      const int8_t* xb[MB];
      int32_t bsum[MB];
      for (int m = 0; m < MB; ++m) {
        xb[m] = p.xq->q.data() + (m0 + m) * p.K + b * kBlock;
        bsum[m] = p.xq->bsum[(m0 + m) * nb + b];
      }
      __m256i dot[MB];
      few_rows_dots<MB, kInt4, kVnni>(wb, xb, bsum, dot);
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
