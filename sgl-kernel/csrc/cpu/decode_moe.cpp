#include "decode_moe.h"

#include "common.h"
#include "linear_wq_a8.h"

namespace {

ExpertPanelsForm expert_form(ExpertPanelTuple t) {
  auto [q, scales, offsets, bits, group_size, zero_point] = std::move(t);
  return {std::move(q), std::move(scales), std::move(offsets), bits, group_size, zero_point};
}

at::Tensor routed(const DecodeMoe& m, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) {
  return moe_wq_a8_packed(x, ids, weights, m.w13.q, m.w13.scales, m.w13.offsets, m.w13.bits, m.w13.group_size,
                          m.w2.q, m.w2.scales, m.w2.offsets, m.w2.bits, m.w2.group_size, m.w13.zero_point,
                          m.w2.zero_point, 0);
}

}  // namespace

DecodeMoe make_decode_moe(at::Tensor router_w, int64_t top_k, bool renormalize, ExpertPanelTuple w13,
                          ExpertPanelTuple w2, bool shared, c10::optional<at::Tensor> shared_gate_w) {
  TORCH_CHECK(router_w.dim() == 2 && router_w.scalar_type() == at::kFloat && router_w.is_contiguous(),
              "DecodeModel: a MoE router must be a contiguous fp32 [num_experts, hidden]");
  TORCH_CHECK(top_k > 0 && top_k <= router_w.size(0), "DecodeModel: top_k ", top_k, " of ", router_w.size(0),
              " experts");
  TORCH_CHECK(!shared_gate_w.has_value() || (shared && shared_gate_w->dim() == 2 && shared_gate_w->size(0) == 1 &&
                                             shared_gate_w->size(1) == router_w.size(1)),
              "DecodeModel: a shared expert gate must be [1, hidden] beside a shared expert");
  DecodeMoe m{std::move(router_w), top_k, renormalize, expert_form(std::move(w13)), expert_form(std::move(w2)),
              shared, std::move(shared_gate_w)};
  TORCH_CHECK(m.w13.q.dim() == 4 && m.w13.q.size(0) == m.router_w.size(0), "DecodeModel: the router has ",
              m.router_w.size(0), " experts, the panels ", m.w13.q.dim() == 4 ? m.w13.q.size(0) : -1);
  const at::Tensor x0 = at::zeros({1, m.router_w.size(1)}, m.router_w.options());
  const at::Tensor ids = at::zeros({1, 1}, x0.options().dtype(at::kLong));
  const at::Tensor y = routed(m, x0, ids, at::ones({1, 1}, x0.options()));
  TORCH_CHECK(y.size(1) == m.router_w.size(1), "DecodeModel: the experts give ", y.size(1), " columns");
  return m;
}

at::Tensor decode_moe_routed(const DecodeMoe& m, const at::Tensor& x) {
  // layers/moe/topk.py's select_experts, op for op (the same ATen kernels: the same bits).
  const at::Tensor logits = at::linear(x, m.router_w);  // [bs, num_experts]
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, m.top_k, -1);
  if (m.renormalize) weights = weights / weights.sum(-1, true);
  return routed(m, x.contiguous(), ids.contiguous(), weights.contiguous());
}

at::Tensor decode_moe_add_shared(const DecodeMoe& m, const at::Tensor& x, at::Tensor out, const at::Tensor& shared) {
  if (m.shared_gate_w.has_value()) return out + at::sigmoid(at::linear(x, *m.shared_gate_w)) * shared;
  return out + shared;
}
