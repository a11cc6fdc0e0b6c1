// A MoE layer's routed experts in one call, decode steps and prefills alike: each expert's gate/up and
// down projections on int8 activations over its weight panels (wq_a8_panels.h), every expert's
// panels of a projection stacked in one tensor (sgl_kernel/wq_a8_pack.py's pack_wq_a8_experts).
//
// Why: layers/moe/fused_moe_cpu.py's grouped path runs per expert that got tokens a Python loop
// step, two linear_wq_a8_packed calls (each quantizing its rows of x again and opening its own
// parallel region over that expert's panels) and a silu_and_mul, then a torch sort, gather and
// index_add: at one token, 8 experts x 4 layers, ~100 small calls a step whose Python and
// dispatch cost rivals the products' own time. Here x is quantized once, the pairs are sorted by
// expert in C++, and each projection is one parallel region over (expert, panel) of every routed
// expert, so both threads get work even when one expert's 96-256 panels are too few to split well.
// The (expert, panel) items are cut over the threads by rows (a prefill's experts get 1-20 rows
// each), and each expert's run of panels prefetches its weights ahead at every row count: at the
// 1-16 rows an expert gets here, its arithmetic alone does not hide the read from memory.
//
// isa: the panel kernel's path (2 AVX2, 3 AVX-512 VNNI, 0 the best compiled; the same bits).
// Numbers: those of the grouped path bit for bit. The same rows of int8 x meet the same panels
// (a row's result does not depend on its tile), silu_and_mul is fused_ops.cpp's, each pair's
// output is scaled by its weight and rounded before being added to its token's row in the grouped
// path's order (pairs by expert, then by token; index_add_ adds them one at a time).
#include "common.h"
#include "linear_wq_a8.h"
#include "linear_wq_a8_quant.h"
#include "ops.h"
#include "wq_a8_gemm.h"
#include "wq_a8_panels.h"
#include "wq_a8_one_row.h"

namespace {

using wq_a8_panels::kPanel;

// One projection's panels, every local expert's stacked: [E, P, nb, 128 | 256] and [E, P, groups, 8].
struct ExpertPanels {
  const uint8_t* q;
  wq_a8_panels::PanelGroups g;  // expert 0's; expert e's start group_stride() elements on
  int64_t panels, nb, groups, bits, group_size, n, k;

  int64_t q_stride() const { return panels * nb * wq_a8_panels::panel_block_bytes(bits); }
  int64_t group_stride() const { return panels * groups * kPanel; }
  A8Order order() const { return bits == 4 ? A8Order::kNibbleChunks : A8Order::kNatural; }
};

ExpertPanels check_expert_panels(const char* what, const at::Tensor& q, const at::Tensor& s,
                                 const c10::optional<at::Tensor>& o, int64_t zero_point, int64_t experts, int64_t n,
                                 int64_t k, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "moe_wq_a8_packed: ", what, " bits must be 4 or 8, got ", bits);
  TORCH_CHECK(k % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && k % group_size == 0,
              "moe_wq_a8_packed: ", what, " group_size ", group_size, " must be a multiple of 32 dividing K=", k);
  const int64_t panels = (n + kPanel - 1) / kPanel, nb = k / kBlock, groups = k / group_size;
  const wq_a8_panels::PanelGroups g =
      wq_a8_panels::check_panels("moe_wq_a8_packed", q, s, o, zero_point, {experts, panels}, nb, groups, bits);
  return {reinterpret_cast<const uint8_t*>(q.data_ptr()), g, panels, nb, groups, bits, group_size, n, k};
}

// The (token, expert) pairs routed to this rank's experts, grouped by expert in increasing id,
// each expert's in token order (torch.argsort(stable=True) of the flat ids).
struct Routing {
  std::vector<int64_t> token;   // [pairs]
  std::vector<float> weight;    // [pairs]
  std::vector<int64_t> expert;  // [groups]: the expert of each group of pairs
  std::vector<int64_t> start;   // [groups + 1]: group g is pairs start[g] .. start[g + 1]
};

Routing route(const int64_t* ids, const float* weights, int64_t slots, int64_t top_k, int64_t experts) {
  std::vector<int64_t> count(experts + 1, 0);
  for (int64_t j = 0; j < slots; ++j)
    if (ids[j] >= 0 && ids[j] < experts) ++count[ids[j] + 1];
  Routing r;
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e + 1] > 0) {
      r.expert.push_back(e);
      r.start.push_back(count[e]);
    }
    count[e + 1] += count[e];  // now: the first pair of expert e + 1
  }
  r.start.push_back(count[experts]);
  r.token.resize(count[experts]);
  r.weight.resize(count[experts]);
  for (int64_t j = 0; j < slots; ++j) {
    const int64_t e = ids[j];
    if (e < 0 || e >= experts) continue;  // another rank's expert (expert parallelism)
    const int64_t at = count[e]++;
    r.token[at] = j / top_k;
    r.weight[at] = weights[j];
  }
  return r;
}

// Row i of the result is row rows[i] of xq (K inputs, `groups` weight groups per row).
BlockQuantRows gather_rows(const BlockQuantRows& xq, const std::vector<int64_t>& rows, int64_t K, int64_t groups) {
  const int64_t nb = K / kBlock, M = static_cast<int64_t>(rows.size());
  BlockQuantRows g{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * groups),
                   std::vector<int32_t>(M * nb)};
  for (int64_t i = 0; i < M; ++i) {
    std::memcpy(g.q.data() + i * K, xq.q.data() + rows[i] * K, K);
    std::copy_n(xq.scale.data() + rows[i] * nb, nb, g.scale.data() + i * nb);
    std::copy_n(xq.bsum.data() + rows[i] * nb, nb, g.bsum.data() + i * nb);
    std::copy_n(xq.gsum.data() + rows[i] * groups, groups, g.gsum.data() + i * groups);
  }
  return g;
}

#if RS_HAVE_AVX2
// A work item (one panel of one routed expert) costs its expert's rows plus this many rows' worth
// for reading the panel's bytes (at one row the read is most of the item's time; at a prefill's
// 5-16 rows the rows are).
constexpr int64_t kPanelCostRows = 2;

// The items [0, groups * P) cut into one contiguous range per thread of about equal cost (rows +
// kPanelCostRows per item): a prefill's experts get 1-20 rows each, so equal counts of items, as
// at::parallel_for cuts them, can leave one thread with most of the rows. bounds[t] .. bounds[t + 1]
// is thread t's range.
std::vector<int64_t> balanced_bounds(const Routing& r, int64_t P, int64_t threads) {
  const int64_t groups = static_cast<int64_t>(r.expert.size());
  auto cost = [&](int64_t g) { return r.start[g + 1] - r.start[g] + kPanelCostRows; };
  int64_t total = 0;
  for (int64_t g = 0; g < groups; ++g) total += cost(g) * P;
  std::vector<int64_t> bounds(threads + 1, groups * P);
  bounds[0] = 0;
  int64_t g = 0, before = 0;  // before: the cost of groups [0, g)
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = total * t / threads;  // thread t starts at the first item at or past it
    while (g < groups && before + cost(g) * P <= target) before += cost(g++) * P;
    bounds[t] = g == groups ? groups * P : g * P + (target - before + cost(g) - 1) / cost(g);
    bounds[t] = std::max(bounds[t], bounds[t - 1]);
  }
  return bounds;
}

// y [pairs, proj.n]: each group's rows of xq against its expert's panels, one parallel region over
// every (group, panel), cut by balanced_bounds.
void run_projection(const ExpertPanels& proj, const BlockQuantRows& xq, const Routing& r, float* y, int64_t isa) {
  const int64_t P = proj.panels, items = static_cast<int64_t>(r.expert.size()) * P;
  const int64_t pairs = r.start.back();
  const int64_t threads = std::min<int64_t>(rs::get_num_threads(), items);
  const std::vector<int64_t> bounds = balanced_bounds(r, P, threads);
  auto run = [&](int64_t i0, int64_t i1) {
    // One run of panels per group in [i0, i1) (one_row_run and gemm_block prefetch along a run).
    for (int64_t i = i0, next; i < i1; i = next) {
      const int64_t g = i / P, panel = i % P, e = r.expert[g];
      next = std::min(i1, (g + 1) * P);
      const int64_t elem = proj.g.half ? 2 : 4, at = e * proj.group_stride() * elem;  // expert e's groups
      const wq_a8_panels::PanelGroups groups{static_cast<const char*>(proj.g.s) + at,
                                             proj.g.o != nullptr ? static_cast<const char*>(proj.g.o) + at : nullptr,
                                             proj.g.half, proj.g.zero};
      const wq_a8_panels::PackedProblem p{&xq,
                                          proj.q + e * proj.q_stride(),
                                          groups,
                                          nullptr,
                                          y,
                                          proj.groups,
                                          proj.group_size / kBlock,
                                          pairs,
                                          proj.n,
                                          proj.k};
      // An expert with a batch of rows (prefill): the GEMM tiles, the same bits, prefetching the
      // run's weights (a few rows' arithmetic does not hide their read from memory).
      if (wq_a8_gemm::serves(r.start[g + 1] - r.start[g], isa)) {
        wq_a8_gemm::gemm_block(p, panel, panel + next - i, r.start[g], r.start[g + 1], proj.bits == 4, isa, true);
        continue;
      }
      wq_a8_panels::one_row_run(p, panel, panel + next - i, r.start[g], proj.bits == 4, isa);
    }
  };
  if (threads <= 1) return run(0, items);
  rs::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run(bounds[t], bounds[t + 1]);
  });
}
#endif

// out[token] += weight * y[pair], pair by pair in group order: first every row scaled (rounded
// to fp32 and stored, as the grouped path's mul_), then added (its index_add_).
void combine(const Routing& r, float* y, float* out, int64_t H) {
  const int64_t pairs = r.start.back();
  for (int64_t i = 0; i < pairs; ++i) {
    float* __restrict row = y + i * H;
    const float w = r.weight[i];
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) row[j] *= w;
  }
  for (int64_t i = 0; i < pairs; ++i) {
    float* __restrict dst = out + r.token[i] * H;
    const float* __restrict row = y + i * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) dst[j] += row[j];
  }
}

}  // namespace

at::Tensor moe_wq_a8_packed(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& w13_q, const at::Tensor& w13_scales,
                            const c10::optional<at::Tensor>& w13_offsets, int64_t w13_bits, int64_t w13_group_size,
                            const at::Tensor& w2_q, const at::Tensor& w2_scales,
                            const c10::optional<at::Tensor>& w2_offsets, int64_t w2_bits, int64_t w2_group_size,
                            int64_t w13_zero_point, int64_t w2_zero_point, int64_t isa) {
  TORCH_CHECK(RS_HAVE_AVX2, "moe_wq_a8_packed: needs the AVX2 path, not compiled into this build");
  isa = a8_resolve_isa("moe_wq_a8_packed", isa, false);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "moe_wq_a8_packed: x must be a CPU float32 [T, H] with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.device().is_cpu() && topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() &&
                  topk_ids.dim() == 2 && topk_ids.size(0) == T,
              "moe_wq_a8_packed: topk_ids must be a contiguous int64 [T, top_k] with T = x's rows");
  TORCH_CHECK(topk_weights.device().is_cpu() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous() && topk_weights.sizes() == topk_ids.sizes(),
              "moe_wq_a8_packed: topk_weights must be a contiguous float32 of topk_ids' shape");
  TORCH_CHECK(w13_q.dim() == 4 && w2_q.dim() == 4 && w2_q.size(0) == w13_q.size(0),
              "moe_wq_a8_packed: w13_q and w2_q must be stacked panels [E, P, K / 32, bytes] of the same E");
  const int64_t E = w13_q.size(0), inter = w2_q.size(2) * kBlock;
  const ExpertPanels w13 = check_expert_panels("w13", w13_q, w13_scales, w13_offsets, w13_zero_point, E, 2 * inter, H,
                                                w13_bits, w13_group_size);
  const ExpertPanels w2 =
      check_expert_panels("w2", w2_q, w2_scales, w2_offsets, w2_zero_point, E, H, inter, w2_bits, w2_group_size);
  at::Tensor out = at::zeros({T, H}, x.options());
  const Routing r = route(topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), topk_ids.numel(),
                          topk_ids.size(1), E);
  const int64_t pairs = r.start.back();
  if (pairs == 0) return out;
#if RS_HAVE_AVX2
  // quantize_blocks' bytes, vectorized and on every thread (a prefill's thousands of rows).
  const BlockQuantRows xq =
      wq_a8_gemm::quantize_blocks_parallel(x.data_ptr<float>(), x.stride(0), T, H, w13.group_size, w13.order());
  const BlockQuantRows x_pairs = gather_rows(xq, r.token, H, w13.groups);
  at::Tensor gate_up = at::empty({pairs, 2 * inter}, x.options());  // [pairs, 2 * inter]
  run_projection(w13, x_pairs, r, gate_up.data_ptr<float>(), isa);
  const at::Tensor act = silu_and_mul(gate_up);  // [pairs, inter]
  const BlockQuantRows aq =
      wq_a8_gemm::quantize_blocks_parallel(act.data_ptr<float>(), inter, pairs, inter, w2.group_size, w2.order());
  at::Tensor y = at::empty({pairs, H}, x.options());  // [pairs, H]
  run_projection(w2, aq, r, y.data_ptr<float>(), isa);
  combine(r, y.data_ptr<float>(), out.data_ptr<float>(), H);
#endif
  return out;
}
