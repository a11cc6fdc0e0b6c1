// linear_wq_a8 on a weight repacked at load into panels of 8 output rows (sgl_kernel/cpu.py's
// pack_wq_a8 makes them; layers/group_quant.py keeps them on the form): the products with int8
// activations of linear_wq_a8.cpp, with each vector lane one output row instead of one slice of K.
//
// Why: linear_wq_a8.cpp's row layout sums a block's 32 products into 8 lanes of one row, so each
// row and block needs its own vpmaddwd, int -> float convert, scale product and FMA, and the
// 16-byte int4 load is widened to 256 bits (a vinserti128) first; on Zen 1, where every 256-bit
// op is two 128-bit halves and only one pipe multiplies integers, that ran ~6 G weights/s per
// core. Here one 32-byte load holds 4 bytes of each of 8 rows; x's matching 4 bytes are broadcast
// to all lanes, so vpmaddubsw's pairs stay within one row's lane, and (int4) a block's 8
// vpmaddubsw results add up in int16 before one vpmaddwd (8 * 2 * 15 * 127 = 30480 < 2^15). Per
// block and 8 rows: 4 loads, 4 shifts, 8 masks, 8 vpmaddubsw, 8 adds, then one vpmaddwd, convert,
// scale product (8 rows' scales in one load) and FMA per row of x. One weight load feeds up to 4
// rows of x (register tiling over M), which is what lets int8 activations beat fp32 at 16 rows.
// llama.cpp's repacked Q4_0 "8x8" GEMV (ggml-cpu/repack.cpp) interleaves rows for the same reason.
//
// Layouts (P = ceil(N / 8) panels, nb = K / 32 blocks, rows past N zero):
//   int4: uint8 [P, nb, 128]: chunk c (0..3) at 32 c holds, for row r at 4 r, bytes 4c..4c+3 of
//         row r's 16-byte block (inputs 8c..8c+7: low nibbles the even ones). x per block in
//         A8Order::kNibbleChunks order.
//   int8: int8 [P, nb, 256]: chunk c (0..7) at 32 c holds, for row r at 4 r, inputs 4c..4c+3.
//   scales, offsets: fp32 [P, groups, 8].
// Numerics: those of linear_wq_a8 (exact int32 block dots, then s_x * s_w * dot and the offsets'
// o_w * gsum in fp32): equal to linear_wq_a8_reference up to fp32 summation order.
#include "common.h"
#include "linear_wq_a8.h"
#include "linear_wq_a8_quant.h"
#include "wq_form.h"

namespace {

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

// Every row of x against one panel, 4 rows of x per tile (the panel's bytes stay in L1 between
// tiles).
template <bool kInt4>
void panel_all_m(const PackedProblem& p, int64_t panel) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) panel_tile<4, kInt4>(p, panel, m);
  switch (p.M - m) {
    case 3: panel_tile<3, kInt4>(p, panel, m); break;
    case 2: panel_tile<2, kInt4>(p, panel, m); break;
    case 1: panel_tile<1, kInt4>(p, panel, m); break;
    default: break;
  }
}
#endif

}  // namespace

bool linear_wq_a8_packed_available() { return RS_HAVE_AVX2; }

at::Tensor linear_wq_a8_packed(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_scales,
                               const c10::optional<at::Tensor>& packed_offsets, int64_t n, int64_t bits,
                               int64_t group_size, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(RS_HAVE_AVX2, "linear_wq_a8_packed: needs the AVX2 path, not compiled into this build");
  TORCH_CHECK(bits == 4 || bits == 8, "linear_wq_a8_packed: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_wq_a8_packed: x must be a CPU float32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel, nb = K / kBlock;
  TORCH_CHECK(n >= 0 && K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "linear_wq_a8_packed: group_size ", group_size, " must be a multiple of 32 dividing K=", K);
  const int64_t groups = K / group_size, panel_block = bits == 4 ? 128 : 256;
  TORCH_CHECK(packed_q.device().is_cpu() && packed_q.is_contiguous() &&
                  packed_q.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && packed_q.dim() == 3 &&
                  packed_q.size(0) == P && packed_q.size(1) == nb && packed_q.size(2) == panel_block,
              "linear_wq_a8_packed: packed_q must be a contiguous ", bits == 4 ? "uint8" : "int8", " [", P, ", ",
              nb, ", ", panel_block, "] (pack_wq_a8's) for N=", n, ", K=", K);
  auto check_groups = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == P && t.size(1) == groups && t.size(2) == kPanel,
                "linear_wq_a8_packed: ", name, " must be a contiguous float32 [", P, ", ", groups, ", 8]");
  };
  check_groups(packed_scales, "packed scales");
  const float* o_ptr = nullptr;
  if (packed_offsets.has_value() && packed_offsets->defined()) {
    check_groups(*packed_offsets, "packed offsets");
    o_ptr = packed_offsets->data_ptr<float>();
  }
  const float* bias_ptr = check_bias("linear_wq_a8_packed", bias, n);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
#if RS_HAVE_AVX2
  const bool int4 = bits == 4;
  const BlockQuantRows xq = quantize_blocks(x.data_ptr<float>(), x.stride(0), M, K, group_size,
                                            int4 ? A8Order::kNibbleChunks : A8Order::kNatural);
  const PackedProblem p{&xq,
                        reinterpret_cast<const uint8_t*>(packed_q.data_ptr()),
                        packed_scales.data_ptr<float>(),
                        o_ptr,
                        bias_ptr,
                        y.data_ptr<float>(),
                        groups,
                        group_size / kBlock,
                        M,
                        n,
                        K};
  // Each thread one contiguous run of panels; runs of less than ~16 KB of weight stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (nb * panel_block));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel) int4 ? panel_all_m<true>(p, panel) : panel_all_m<false>(p, panel);
  });
#endif
  return y;
}
