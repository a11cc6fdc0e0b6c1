// The AVX2 panel kernel of linear_wq_a8_packed.cpp (which describes the layout and the numerics),
// shared with moe_wq_a8_packed.cpp: rows of int8-quantized x against one panel of 8 output rows.
// A row's result does not depend on which rows share its tile, so any split of the rows (one
// expert's tokens, all of a product's rows) gives the same numbers.
#pragma once

#include "common.h"
#include "linear_wq_a8_quant.h"

namespace wq_a8_panels {

constexpr int64_t kPanel = 8;  // output rows per panel: one per int32 lane

struct PackedProblem {
  const BlockQuantRows* xq;
  const uint8_t* q;  // panel p starts at q + p * nb * panel_block
  const float* s;    // [P, groups, 8]
  const float* o;    // [P, groups, 8] or nullptr
  const float* bias;
  float* y;
  int64_t groups, blocks_per_group, M, N, K;
};

// Bytes of one panel's block of 32 inputs: 8 rows of 16 (int4) or 32 (int8) bytes.
inline int64_t panel_block_bytes(int64_t bits) { return bits == 4 ? 128 : 256; }

// Panels per parallel task: runs of less than ~16 KB of weight stay on one thread.
inline int64_t grain_panels(int64_t nb, int64_t bits) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / (nb * panel_block_bytes(bits)));
}

// pack_wq_a8's tensors, each with leading dims `lead` ({P}, or {E, P} for stacked experts):
// q [*lead, nb, 128 | 256] uint8 | int8, scales and offsets (optional) fp32 [*lead, groups, 8],
// all contiguous on the CPU. Returns the offsets' data (nullptr without).
inline const float* check_panels(const char* name, const at::Tensor& q, const at::Tensor& scales,
                                 const c10::optional<at::Tensor>& offsets, std::vector<int64_t> lead, int64_t nb,
                                 int64_t groups, int64_t bits) {
  std::vector<int64_t> q_shape = lead, group_shape = lead;
  q_shape.insert(q_shape.end(), {nb, panel_block_bytes(bits)});
  group_shape.insert(group_shape.end(), {groups, kPanel});
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.scalar_type() == (bits == 4 ? at::kByte : at::kChar) &&
                  q.sizes() == at::IntArrayRef(q_shape),
              name, ": packed_q must be a contiguous ", bits == 4 ? "uint8 " : "int8 ", at::IntArrayRef(q_shape),
              " (pack_wq_a8's), got ", q.scalar_type(), " ", q.sizes());
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.sizes() == at::IntArrayRef(group_shape),
                name, ": ", what, " must be a contiguous float32 ", at::IntArrayRef(group_shape));
  };
  check_groups(scales, "packed scales");
  if (!offsets.has_value() || !offsets->defined()) return nullptr;
  check_groups(*offsets, "packed offsets");
  return offsets->data_ptr<float>();
}

#if RS_HAVE_AVX2
// x's 4 bytes at q broadcast to every lane.
inline __m256i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return _mm256_set1_epi32(v);
}

// MB rows of x (from m0) against one panel: y[m0 .. m0 + MB, the panel's rows].
template <int MB, bool kInt4>
inline void panel_tile(const PackedProblem& p, int64_t panel, int64_t m0) {
  constexpr int64_t kChunks = kInt4 ? 4 : 8, kPanelBlock = kChunks * 32;
  const int64_t nb = p.K / kBlock, bpg = p.blocks_per_group;
  const uint8_t* wq = p.q + panel * nb * kPanelBlock;
  const float* sc = p.s + panel * p.groups * kPanel;
  const float* of = p.o != nullptr ? p.o + panel * p.groups * kPanel : nullptr;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wq + b * kPanelBlock;
    const int8_t* xb[MB];
    for (int m = 0; m < MB; ++m) xb[m] = p.xq->q.data() + (m0 + m) * p.K + b * kBlock;
    __m256i dot[MB];
    if constexpr (kInt4) {
      __m256i s16[MB];
      for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
      for (int c = 0; c < kChunks; ++c) {
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
      // Signed weights: |w| against x * sign(w) (pairs at most 2 * 128 * 127, so each chunk is
      // widened to int32 at once).
      for (int m = 0; m < MB; ++m) dot[m] = _mm256_setzero_si256();
      for (int c = 0; c < kChunks; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int m = 0; m < MB; ++m) {
          const __m256i sx = _mm256_sign_epi8(bcast4(xb[m] + 4 * c), w);
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
    }
    const int64_t g = b / bpg;
    const __m256 sw = _mm256_loadu_ps(sc + g * kPanel);
    for (int m = 0; m < MB; ++m) {
      const __m256 sx = _mm256_set1_ps(p.xq->scale[(m0 + m) * nb + b]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(sw, sx), acc[m]);
    }
    if (of != nullptr && b % bpg == bpg - 1) {
      // The group's offsets times x's dequantized sum over the group.
      const __m256 ow = _mm256_loadu_ps(of + g * kPanel);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm256_fmadd_ps(ow, _mm256_set1_ps(p.xq->gsum[(m0 + m) * p.groups + g]), acc[m]);
    }
  }
  const int64_t n0 = panel * kPanel, rows = std::min(kPanel, p.N - n0);
  alignas(32) float out[kPanel];
  for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(out, acc[m]);
    float* y = p.y + (m0 + m) * p.N + n0;
    for (int64_t r = 0; r < rows; ++r) y[r] = p.bias != nullptr ? out[r] + p.bias[n0 + r] : out[r];
  }
}

// Rows [m0, m1) of x against one panel, 4 rows of x per tile (the panel's bytes stay in L1
// between tiles). Each row's arithmetic is the same whatever tile it falls in.
template <bool kInt4>
inline void panel_rows(const PackedProblem& p, int64_t panel, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) panel_tile<4, kInt4>(p, panel, m);
  switch (m1 - m) {
    case 3: panel_tile<3, kInt4>(p, panel, m); break;
    case 2: panel_tile<2, kInt4>(p, panel, m); break;
    case 1: panel_tile<1, kInt4>(p, panel, m); break;
    default: break;
  }
}

inline void panel_rows(const PackedProblem& p, int64_t panel, int64_t m0, int64_t m1, bool int4) {
  int4 ? panel_rows<true>(p, panel, m0, m1) : panel_rows<false>(p, panel, m0, m1);
}
#endif

}  // namespace wq_a8_panels
