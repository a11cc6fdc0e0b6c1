// The CPU ops of sgl_kernel._cpu, shared by the bindings and by the fused decode model.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

// K/V: float32, bfloat16, float8_e4m3fn, float8_e5m2, or int8 with k_scale / v_scale fp32 [N, Hkv]
// (value = int8 * scale of its slot and KV head); dequantized as they are read.
void decode_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale, const c10::optional<at::Tensor>& k_scale = c10::nullopt,
    const c10::optional<at::Tensor>& v_scale = c10::nullopt);

void extend_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    const at::Tensor& extend_lens, double scale, const c10::optional<at::Tensor>& tree_mask,
    const c10::optional<at::Tensor>& k_scale = c10::nullopt, const c10::optional<at::Tensor>& v_scale = c10::nullopt);

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
// W8A8: x fp32 [M, K] quantized per row inside, w int8 [N, K] with w_scale fp32 [N]. isa: 0 the
// best compiled path, 1 scalar, 2 AVX2, 3 AVX-512 VNNI (tests force each one).
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias, int64_t isa);
std::vector<std::string> linear_int8_isas();
// Weight-only group-quantized: x fp32 [M, K]; qweight int8 [N, K] (bits 8) or uint8 [N, K / 2]
// (bits 4, low nibble first); scales (and optional offsets) fp32 [N, K / group_size], or both
// fp16 (widened exactly): w = q * scale (+ offset). fp32 math. isa as linear_int8's (3: AVX-512F).
at::Tensor linear_wq(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, int64_t isa);
std::vector<std::string> linear_wq_isas();
// Greedy LM head: for each row of x fp32 [M, K], the vocabulary rows that may hold its argmax,
// from an int8 copy u [N, K] of the head with per-row stats fp32 [N, 3] (greedy_head.cpp).
// Returns (indices int64 [C], per-row counts int64 [M]; -1: x not finite, nothing proven).
std::tuple<at::Tensor, at::Tensor> greedy_head_candidates(const at::Tensor& x, const at::Tensor& u,
                                                          const at::Tensor& stats, double umax, int64_t isa);
std::vector<std::string> greedy_head_isas();

// LoRA delta, in place: out[t] += (x[t] @ a[s]^T) @ b[s] for every row t with slot s = token_slots[t]
// >= 0 (lora.cpp). x / out fp32 or bf16 [n, in] / [n, out] (rows contiguous, any row stride);
// a [slots, rank, in], b [slots, rank, out] contiguous fp32 or bf16; fp32 accumulation.
void lora_delta_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& token_slots,
                 at::Tensor& out);

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rmsnorm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps);
void rotary_neox_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                  const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
// torch.argmax(x, dim=-1) of a fp32 [rows, n] with contiguous rows (the first index of each row's
// maximum, a NaN the greatest), vectorized (argmax_rows.cpp): int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x);
// argmax_rows and, per row, whether the chosen logit is not finite: (int64 [rows], bool [rows]).
// Takes any CPU float [rows, n] (made fp32 with contiguous rows first when it is not).
std::tuple<at::Tensor, at::Tensor> argmax_rows_checked(const at::Tensor& logits);
// k_buf[loc] = k; v_buf[loc] = v (k/v fp32 [T, Hkv, D]); a bf16 / fp8 / int8 pool gets each row
// quantized as mem_cache/kv_dtype.py does (int8: its scale into k_scale / v_scale fp32 [N, Hkv]).
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v,
              const c10::optional<at::Tensor>& k_scale = c10::nullopt,
              const c10::optional<at::Tensor>& v_scale = c10::nullopt);
