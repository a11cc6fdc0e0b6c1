#include "decode_lora.h"

#include <algorithm>

std::vector<LoraPart> lora_parts(std::vector<LoraPartTuple> parts, int64_t in, int64_t out, int64_t num_slots,
                                 const char* name) {
  std::vector<LoraPart> checked;
  std::vector<std::pair<int64_t, int64_t>> spans;  // [offset, end) of each part
  for (auto& [a, b, offset] : parts) {
    TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.dim() == 3 && b.dim() == 3 && a.is_contiguous() &&
                    b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                    (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                "DecodeModel: ", name, "'s LoRA buffers must be contiguous fp32 or bf16 CPU a [slots, rank, in], "
                "b [slots, rank, out] of one dtype");
    TORCH_CHECK(a.size(0) == num_slots && b.size(0) == num_slots && a.size(1) == b.size(1),
                "DecodeModel: ", name, "'s LoRA buffers have ", a.size(0), " and ", b.size(0), " slots and ranks ",
                a.size(1), " and ", b.size(1), "; the model's LoRA has ", num_slots, " slots");
    TORCH_CHECK(a.size(1) <= lora_max_rank(), "DecodeModel: LoRA rank ", a.size(1), " is above ", lora_max_rank());
    TORCH_CHECK(a.size(2) == in && offset >= 0 && offset + b.size(2) <= out, "DecodeModel: ", name,
                "'s LoRA part (in ", a.size(2), ", columns ", offset, "..", offset + b.size(2),
                ") does not fit the projection [", in, " -> ", out, "]");
    spans.emplace_back(offset, offset + b.size(2));
    checked.push_back(LoraPart{std::move(a), std::move(b), offset});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK(spans[i].first >= spans[i - 1].second, "DecodeModel: ", name, "'s LoRA parts overlap");
  return checked;
}

void add_lora(const std::vector<LoraPart>& parts, const at::Tensor& x, at::Tensor& y, const LoraPlan& plan) {
  for (const LoraPart& part : parts) {
    at::Tensor cols = y.narrow(1, part.offset, part.b.size(2));  // [bs, width]: a view of y's columns
    lora_apply_(x, part.a, part.b, plan, cols);
  }
}
