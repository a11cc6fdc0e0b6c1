// LoRA adapters in the fused decode stack (decode_model.cpp). Each adapted projection adds
// (x @ A[s]^T) @ B[s] for the rows whose slot s >= 0 into its output, right after the projection
// (before a row-parallel projection's all-reduce, so a TP rank's part is a partial sum like its
// base output): what radixserve/lora/manager.py's hooks do on the module forward.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "lora.h"

// One adapted slice of a fused projection's output (q, k or v of qkv_proj; gate or up of
// gate_up_proj; all of o_proj / down_proj): a [slots, rank, in] and b [slots, rank, width] are the
// LoRA pool's slot buffers themselves (shared storage, never copied), so an adapter copied into a
// slot is read by the next step with nothing rebuilt. The delta goes into output columns
// [offset, offset + width).
struct LoraPart {
  at::Tensor a, b;
  int64_t offset = 0;
};
using LoraPartTuple = std::tuple<at::Tensor, at::Tensor, int64_t>;

// A layer's parts per fused projection; an empty list: that projection is not adapted.
struct LayerLora {
  std::vector<LoraPart> qkv, o, gate_up, down;
};

// `parts` of a projection [in -> out], checked: fp32/bf16 contiguous buffers of `num_slots` slots
// and one rank (at most lora_max_rank()) that fit the projection and do not overlap.
std::vector<LoraPart> lora_parts(std::vector<LoraPartTuple> parts, int64_t in, int64_t out, int64_t num_slots,
                                 const char* name);

// y [bs, out] += each part's delta of x [bs, in] into its columns, for the rows of `plan`.
void add_lora(const std::vector<LoraPart>& parts, const at::Tensor& x, at::Tensor& y, const LoraPlan& plan);
