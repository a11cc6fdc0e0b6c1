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
//   scales, offsets: [P, groups, 8], fp16 where that is exact (GGUF's scales: the file's bytes,
//         widened with F16C's vcvtph2ps), else fp32. A zero point instead of offsets (Q4_0's 8:
//         o = -8 s) forms o from s in registers, so Q4_0 panels are 18 bytes a row-block as in the
//         file, not 24 (fp32 scale and offset).
// VNNI (isa 3, AVX512VL + AVX512_VNNI): each chunk's vpmaddubsw (+ add) is one vpdpbusd into the
// row's int32 lane; int8 panels read w + 128 and start each lane at -128 * the block's sum(q).
// The int32 block dots are the AVX2 path's, so its bits. 256-bit vectors: 8 lanes are one panel,
// and Zen 4 runs a 512-bit op as two 256-bit halves anyway.
// Numerics: those of linear_wq_a8 (exact int32 block dots, then s_x * s_w * dot and the offsets'
// o_w * gsum in fp32): equal to linear_wq_a8_reference up to fp32 summation order, and the same
// bits whether the scales are stored fp16 or fp32 and the offsets stored or formed.
#include "common.h"
#include "linear_wq_a8.h"
#include "linear_wq_a8_quant.h"
#include "wq_a8_gemm.h"
#include "wq_a8_panels.h"
#include "wq_a8_one_row.h"
#include "wq_form.h"

using wq_a8_panels::kPanel;

#if RS_HAVE_AVX2
// A batch (wq_a8_gemm::serves: 2 rows or more, VNNI or AVX2) on the GEMM tiles: x quantized (on every thread past
// kInlineQuantElems), then the panel pairs (the tiles take two panels at a time): a decode batch
// (one row chunk) in runs the threads pull (parallel_chunks), a longer one in one contiguous run a
// thread (each sweeps its panels once per row chunk with that chunk's x hot in its L2).
static void linear_wq_a8_gemm(const at::Tensor& x, const at::Tensor& packed_q, const wq_a8_panels::PanelGroups& pg,
                              const float* bias, at::Tensor& y, int64_t groups, int64_t group_size, int64_t n,
                              bool int4, int64_t isa) {
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel, nb = K / kBlock;
  const BlockQuantRows xq = wq_a8_gemm::quantize_blocks_parallel(
      x.data_ptr<float>(), x.stride(0), M, K, group_size, int4 ? A8Order::kNibbleChunks : A8Order::kNatural);
  const wq_a8_panels::PackedProblem p{
      &xq, reinterpret_cast<const uint8_t*>(packed_q.data_ptr()), pg, bias, y.data_ptr<float>(), groups,
      group_size / kBlock, M, n, K};
  const int64_t pairs = (P + 1) / 2, grain = std::max<int64_t>(1, wq_a8_panels::grain_panels(nb, int4 ? 4 : 8) / 2);
  // Each run prefetches its next panels' weights (gemm_block) as the MoE experts' runs do: a decode
  // batch's few tiles a panel pair otherwise wait on the weights streaming from memory (a model's
  // layers are far past L3).
  const auto run = [&](int64_t q0, int64_t q1) {
    wq_a8_gemm::gemm_block(p, 2 * q0, std::min(P, 2 * q1), 0, M, int4, isa, /*prefetch=*/true);
  };
  if (M <= wq_a8_gemm::kRowChunk)
    wq_a8_gemm::parallel_chunks(pairs, wq_a8_gemm::chunk_for(pairs, grain), run);
  else
    rs::parallel_for(0, pairs, grain, run);
}
#endif

bool linear_wq_a8_packed_available() { return RS_HAVE_AVX2; }

at::Tensor linear_wq_a8_packed(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_scales,
                               const c10::optional<at::Tensor>& packed_offsets, int64_t n, int64_t bits,
                               int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t zero_point,
                               int64_t isa) {
  TORCH_CHECK(RS_HAVE_AVX2, "linear_wq_a8_packed: needs the AVX2 path, not compiled into this build");
  isa = a8_resolve_isa("linear_wq_a8_packed", isa, false);
  TORCH_CHECK(bits == 4 || bits == 8, "linear_wq_a8_packed: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_wq_a8_packed: x must be a CPU float32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel, nb = K / kBlock;
  TORCH_CHECK(n >= 0 && K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "linear_wq_a8_packed: group_size ", group_size, " must be a multiple of 32 dividing K=", K);
  const int64_t groups = K / group_size;
  const wq_a8_panels::PanelGroups pg = wq_a8_panels::check_panels(
      "linear_wq_a8_packed", packed_q, packed_scales, packed_offsets, zero_point, {P}, nb, groups, bits);
  const float* bias_ptr = check_bias("linear_wq_a8_packed", bias, n);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
#if RS_HAVE_AVX2
  const bool int4 = bits == 4;
  if (wq_a8_gemm::serves(M, isa)) {
    linear_wq_a8_gemm(x, packed_q, pg, bias_ptr, y, groups, group_size, n, int4, isa);
    return y;
  }
  // One row (the one-row work's domain, wq_a8_one_row.h): one contiguous run of panels a thread;
  // short products stay on one thread (grain_panels). x is quantized by the tiles' vectorized
  // quantizer (the same bytes as quantize_blocks; one row runs inline): the scalar one took 2-3.6 us
  // of each one-row call, ~4-7% of the built-in model's fused stack at one request (Zen 3,
  // docs/cpu_backend.md).
  const BlockQuantRows xq = wq_a8_gemm::quantize_blocks_parallel(
      x.data_ptr<float>(), x.stride(0), M, K, group_size, int4 ? A8Order::kNibbleChunks : A8Order::kNatural);
  const wq_a8_panels::PackedProblem p{
      &xq, reinterpret_cast<const uint8_t*>(packed_q.data_ptr()), pg, bias_ptr, y.data_ptr<float>(), groups,
      group_size / kBlock, M, n, K};
  rs::parallel_for(0, P, wq_a8_panels::grain_panels(nb, bits), [&](int64_t p0, int64_t p1) {
    wq_a8_panels::one_row_run(p, p0, p1, 0, int4, isa);
  });
#endif
  return y;
}
