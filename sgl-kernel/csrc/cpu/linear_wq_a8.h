// linear_wq with x quantized to int8 per block of 32 inputs (linear_wq_a8.cpp); declared apart from
// ops.h. The fused decode model (decode_model.cpp) calls it for the wq forms marked for int8
// activations, as layers/group_quant.py does on the module forward.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

// x fp32 [M, K]; qweight, scales, offsets, bits as linear_wq's; group_size a multiple of 32. x is
// quantized per 32 inputs (scale amax / 127, round half to even) and each block's products summed
// in int32. isa: 0 the best compiled path, 1 scalar, 2 AVX2, 3 AVX-512 VNNI (linear_wq_a8_isas();
// the AVX2 and VNNI paths give the same bits).
at::Tensor linear_wq_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, int64_t isa);
std::vector<std::string> linear_wq_a8_isas();

// The same product on a weight repacked into panels of 8 output rows (linear_wq_a8_packed.cpp
// describes the layout; sgl_kernel/cpu.py's pack_wq_a8 makes it): packed_q [P, K / 32, 128 (int4)
// or 256 (int8)], packed_scales / packed_offsets fp32 or fp16 [P, groups, 8], P = ceil(n / 8);
// zero_point (int4, no offsets; 0: none): w = scale * (q - zero_point). AVX2 builds only
// (linear_wq_a8_packed_available()); isa as linear_wq_a8's but no scalar path (0, 2 or 3).
at::Tensor linear_wq_a8_packed(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_scales,
                               const c10::optional<at::Tensor>& packed_offsets, int64_t n, int64_t bits,
                               int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t zero_point,
                               int64_t isa = 0);
bool linear_wq_a8_packed_available();

// A MoE layer's routed experts on int8 activations (moe_wq_a8_packed.cpp): x fp32 [T, H], topk_ids
// int64 / topk_weights fp32 [T, top_k] (ids outside [0, E): another rank's experts, skipped);
// w13_* every expert's gate-then-up rows [2 * inter, H] and w2_* its down projection [H, inter],
// as pack_wq_a8 panels stacked over the E experts ([E, P, K / 32, 128 | 256], [E, P, groups, 8]),
// each with its zero point (linear_wq_a8_packed's).
// isa: the panel kernel's path, as linear_wq_a8_packed's.
// Returns fp32 [T, H]: sum over each token's pairs of weight * down(silu(gate) * up).
at::Tensor moe_wq_a8_packed(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& w13_q, const at::Tensor& w13_scales,
                            const c10::optional<at::Tensor>& w13_offsets, int64_t w13_bits, int64_t w13_group_size,
                            const at::Tensor& w2_q, const at::Tensor& w2_scales,
                            const c10::optional<at::Tensor>& w2_offsets, int64_t w2_bits, int64_t w2_group_size,
                            int64_t w13_zero_point, int64_t w2_zero_point, int64_t isa = 0);
