// The argument checks linear_wq.cpp and linear_wq_a8.cpp share: x fp32 [M, K] with contiguous rows
// against one weight-only group-quantized weight (qweight, scales, offsets, bias as linear_wq.cpp
// describes them). One definition, so the entry points refuse the same inputs with the same
// messages (each prefixed with its own name); linear_wq_a8_packed.cpp shares the bias check.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

struct WqForm {
  int64_t M, K, N, groups;
  const void* offsets;  // nullptr: w = q * scale; fp32, or fp16 where `half`
  const float* bias;    // nullptr: no bias
  bool half;            // scales and offsets are fp16 (only where the caller allowed it)
};

// The optional bias of an [M, N] output: a contiguous float32 [N] on the CPU, or nullptr when absent.
inline const float* check_bias(const char* name, const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                  bias->numel() == N,
              name, ": bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

// `block`: what group_size must be a multiple of (16 for linear_wq, 32 for linear_wq_a8).
// `allow_half`: scales (and offsets, then of the same dtype) may be fp16 as well as fp32.
inline WqForm check_wq_form(const char* name, const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& offsets, int64_t bits,
                            int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t block,
                            bool allow_half = false) {
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu(), name,
              ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              ": x must be float32 [M, K] with contiguous rows");
  const auto q_type = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == q_type, name, ": ", bits,
              "-bit qweight must be a contiguous ", bits == 8 ? "int8 [N, K]" : "uint8 [N, K / 2]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t qK = qweight.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(qK == K, name, ": x has K=", K, " but qweight holds K=", qK);
  TORCH_CHECK(group_size > 0 && group_size % block == 0 && K % group_size == 0, name, ": group_size ", group_size,
              " must be a multiple of ", block, " dividing K=", K);
  const int64_t groups = K / group_size;
  const bool half = allow_half && scales.scalar_type() == at::kHalf;
  const auto g_type = half ? at::kHalf : at::kFloat;
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == g_type && t.is_contiguous() && t.dim() == 2 &&
                    t.size(0) == N && t.size(1) == groups,
                name, ": ", what, " must be a contiguous ", half ? "float16" : "float32", " [", N, ", ", groups,
                "]", allow_half ? " (scales and offsets fp32, or both fp16)" : "");
  };
  check_groups(scales, "scales");
  const void* o_ptr = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    check_groups(*offsets, "offsets");
    o_ptr = offsets->data_ptr();
  }
  return {M, K, N, groups, o_ptr, check_bias(name, bias, N), half};
}
