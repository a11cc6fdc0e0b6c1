// A MoE layer's sparse MLP inside DecodeModel's one-call decode step (decode_model.h): the router
// linear, softmax top-k (renormalised or not), the routed experts through moe_wq_a8_packed on their
// stacked int8-activation panels, and the shared expert (the layer's dense MLP slot) with its gate.
//
// Why: at one token a MoE decode step run by the module forward spends ~1 ms a layer in Python and
// small dispatches (router, softmax, topk, the call into the expert kernel, the shared expert's
// ops) beside ~1-3 ms of products; here the layer loop never leaves C++.
// Numbers: the module forward's (models/moe_decoder.py's SparseMoeBlock) bit for bit: the same ATen
// ops in the same order for the router and top-k (layers/moe/topk.py), the same kernel for the
// experts (layers/moe/fused_moe_a8.py), the same linears for the shared expert.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// One projection of every local expert as sgl_kernel's WqA8PackedExperts holds it:
// (q [E, P, K / 32, bytes], scales, offsets or None, bits, group_size, zero_point).
using ExpertPanelTuple = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t, int64_t, int64_t>;

struct ExpertPanelsForm {
  at::Tensor q, scales;
  c10::optional<at::Tensor> offsets;
  int64_t bits = 0, group_size = 0, zero_point = 0;
};

struct DecodeMoe {
  at::Tensor router_w;  // [num_experts, hidden] fp32 (nn.Linear's weight, no bias)
  int64_t top_k = 0;
  bool renormalize = false;
  ExpertPanelsForm w13, w2;
  // The shared expert's output runs through the layer's dense MLP slot (gate_up_w / down_w); false:
  // the layer has none and that slot is unused.
  bool shared = false;
  c10::optional<at::Tensor> shared_gate_w;  // [1, hidden] fp32: sigmoid(x @ g.T) scales the shared output
};

// Checked by running the experts once on a zero row (moe_wq_a8_packed validates the layouts).
DecodeMoe make_decode_moe(at::Tensor router_w, int64_t top_k, bool renormalize, ExpertPanelTuple w13,
                          ExpertPanelTuple w2, bool shared, c10::optional<at::Tensor> shared_gate_w);

// x [bs, hidden] fp32 -> the routed experts' combined output [bs, hidden] (the shared expert not
// included: the caller adds it, see DecodeModel::forward).
at::Tensor decode_moe_routed(const DecodeMoe& moe, const at::Tensor& x);

// routed + sigmoid(x @ g.T) * shared (or routed + shared without a gate): SparseMoeBlock's sum.
at::Tensor decode_moe_add_shared(const DecodeMoe& moe, const at::Tensor& x, at::Tensor routed,
                                 const at::Tensor& shared);
