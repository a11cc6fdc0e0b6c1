// The panels of linear_wq_a8_packed.cpp (which describes the layout and the numerics), shared with
// moe_wq_a8_packed.cpp: their checks, and the AVX2 and AVX-512 VNNI block dots of int8-quantized x
// against one panel of 8 output rows (the one-row work's, wq_a8_one_row.h; the GEMM tiles',
// wq_a8_gemm.h, give the same int32s). A row's result does not depend on which rows share its
// tile, so any split of the rows (one expert's tokens, all of a product's rows) gives the same numbers.
#pragma once

#include "common.h"
#include "linear_wq_a8_quant.h"

namespace wq_a8_panels {

constexpr int64_t kPanel = 8;  // output rows per panel: one per int32 lane

// A panel stack's per-group numbers: scales, and offsets or a zero point (w = scale * (q - zero):
// the offset -zero * scale formed in registers, so Q4_0 reads no offset stream), all fp32 or all
// fp16 (pack_wq_a8 stores fp16 where that is exact, as GGUF's scales are: fewer bytes a token).
struct PanelGroups {
  const void* s;  // [P, groups, 8]
  const void* o;  // [P, groups, 8] or nullptr
  bool half;      // s and o are fp16
  float zero;     // o == nullptr: offsets -zero * scale (0: none)
};

struct PackedProblem {
  const BlockQuantRows* xq;
  const uint8_t* q;  // panel p starts at q + p * nb * panel_block
  PanelGroups g;     // panel p's groups start at element p * groups * 8
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
// q [*lead, nb, 128 | 256] uint8 | int8, scales and offsets (optional) [*lead, groups, 8], both
// fp32 or both fp16, all contiguous on the CPU; zero_point (int4 only, without offsets) in [0, 16).
inline PanelGroups check_panels(const char* name, const at::Tensor& q, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& offsets, int64_t zero_point,
                                std::vector<int64_t> lead, int64_t nb, int64_t groups, int64_t bits) {
  std::vector<int64_t> q_shape = lead, group_shape = lead;
  q_shape.insert(q_shape.end(), {nb, panel_block_bytes(bits)});
  group_shape.insert(group_shape.end(), {groups, kPanel});
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.scalar_type() == (bits == 4 ? at::kByte : at::kChar) &&
                  q.sizes() == at::IntArrayRef(q_shape),
              name, ": packed_q must be a contiguous ", bits == 4 ? "uint8 " : "int8 ", at::IntArrayRef(q_shape),
              " (pack_wq_a8's), got ", q.scalar_type(), " ", q.sizes());
  const auto dtype = scales.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf, name, ": packed scales must be float32 or float16, got ",
              dtype);
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                    t.sizes() == at::IntArrayRef(group_shape),
                name, ": ", what, " must be a contiguous ", dtype, " ", at::IntArrayRef(group_shape));
  };
  check_groups(scales, "packed scales");
  const bool with_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(zero_point == 0 || (bits == 4 && !with_offsets && zero_point > 0 && zero_point < 16), name,
              ": zero_point ", zero_point, " needs int4 panels without offsets and lies in [0, 16)");
  if (with_offsets) check_groups(*offsets, "packed offsets");
  return {scales.data_ptr(), with_offsets ? offsets->data_ptr() : nullptr, dtype == at::kHalf,
          static_cast<float>(zero_point)};
}

#if RS_HAVE_AVX2
// An empty asm that claims to change v, so the adds before and after it stay in their order and
// v stays in a register. Without it GCC reassociates a block's integer sums (legal: int adds are
// associative) into a tree over every vpmaddubsw result of the block, which with several rows of
// x left 16 ymm registers too few: each result went to the stack and back (the 4-row int4 tile:
// 32 stores and 32 loads a block; AVX2 has 16 ymm registers, AVX-512's 32 hid this).
inline void keep_in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

// x's 4 bytes at q broadcast to every lane.
inline __m256i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return _mm256_set1_epi32(v);
}

// 8 lanes of fp32 from element i of an fp32 or (kHalf, F16C: exact) fp16 array.
template <bool kHalf>
inline __m256 load8(const void* base, int64_t i) {
  if constexpr (kHalf)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

#if RS_HAVE_A8_VNNI
// The block's exact int32 dots (one lane per panel row) of one row of x by vpdpbusd: the AVX2
// sums below, in one instruction per chunk instead of two to four, so the same int32s. Two
// accumulators (int4: low / high nibbles; int8: even / odd chunks) halve the dependency chain.
// int8 weights are read as w + 128 (unsigned) and the lanes start at -128 * the block's sum(q)
// (bsum), which takes the 128s back off.
template <bool kInt4>
inline __m256i row_block_dot_vnni(const uint8_t* wb, const int8_t* xb, int32_t bsum) {
  __m256i d0 = kInt4 ? _mm256_setzero_si256() : _mm256_set1_epi32(-128 * bsum), d1 = _mm256_setzero_si256();
  if constexpr (kInt4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      d0 = _mm256_dpbusd_epi32(d0, _mm256_and_si256(raw, low4), bcast4(xb + 8 * c));
      d1 = _mm256_dpbusd_epi32(d1, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), bcast4(xb + 8 * c + 4));
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 8; c += 2) {
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c)), flip);
      const __m256i w1 =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c + 32)), flip);
      d0 = _mm256_dpbusd_epi32(d0, w0, bcast4(xb + 4 * c));
      d1 = _mm256_dpbusd_epi32(d1, w1, bcast4(xb + 4 * c + 4));
    }
  }
  return _mm256_add_epi32(d0, d1);
}
#endif

// The block's exact int32 dots (one lane per panel row) of one row of x on AVX2. int4: the
// block's 8 vpmaddubsw add up in int16 (8 * 2 * 15 * 127 = 30480 < 2^15) before one vpmaddwd;
// int8: |w| against x * sign(w) (pairs at most 2 * 128 * 127, so each chunk is widened to int32
// at once). Integer sums in any order are the same, so the adds are a tree (a shorter chain).
template <bool kInt4>
inline __m256i row_block_dot_avx2(const uint8_t* wb, const int8_t* xb) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kInt4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i part[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      part[c] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(raw, low4), bcast4(xb + 8 * c)),
                                 _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                                      bcast4(xb + 8 * c + 4)));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(part[0], part[1]), _mm256_add_epi16(part[2], part[3])),
                             ones);
  } else {
    __m256i part[4];
    for (int c = 0; c < 8; c += 2) {
      __m256i two[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * (c + h)));
        two[h] = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xb + 4 * (c + h)), w)), ones);
      }
      part[c / 2] = _mm256_add_epi32(two[0], two[1]);
    }
    return _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]), _mm256_add_epi32(part[2], part[3]));
  }
}

// The block dots on the chosen path (kVnni: row_block_dot_vnni; the same int32s, so the same bits).
template <bool kInt4, bool kVnni>
inline __m256i row_block_dot(const uint8_t* wb, const int8_t* xb, int32_t bsum) {
#if RS_HAVE_A8_VNNI
  if constexpr (kVnni) return row_block_dot_vnni<kInt4>(wb, xb, bsum);
#endif
  (void)bsum;
  return row_block_dot_avx2<kInt4>(wb, xb);
}

#endif

}  // namespace wq_a8_panels
