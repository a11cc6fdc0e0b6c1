// A Llama-family decoder stack (Llama, Qwen2 biases, Qwen3 q/k norms) run for one decode step in a
// single call: the CPU counterpart of a CUDA graph. At small batches a decode step is ~30 layers x
// ~15 Python-level ops whose dispatch costs more than their arithmetic; here the whole stack runs
// in C++ over the same kernels (and the same weight and KV tensors) the Python path uses.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "decode_lora.h"
#include "decode_moe.h"
#include "shm_comm.h"

// A weight-only group-quantized weight (layers/group_quant.py's GroupQuantWeight): qweight, scales,
// offsets (or None), bits, group_size, as linear_wq takes them.
using WqTuple = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t, int64_t>;

struct WqForm {
  at::Tensor qweight, scales;
  c10::optional<at::Tensor> offsets;
  int64_t bits = 0, group_size = 0;
  // May quantize its activations to int8 per 32 inputs (linear_wq_a8.h) at batches of at most
  // DecodeModel's wq_a8_max_tokens rows: the module forward's rule (layers/group_quant.py).
  bool int8_activations = false;
  // linear_wq_a8's 8-row panels of the same weight (set_layer_wq_a8_panels; --cpu-wq-int8-activations):
  // when set, the int8-activation product reads them, as the module forward does (group_quant.py).
  c10::optional<at::Tensor> panel_q, panel_scales, panel_offsets;
  int64_t panel_zero_point = 0;
};

// A weight's panels as sgl_kernel.cpu.pack_wq_a8 makes them: (q, scales, offsets or None, zero_point).
using PanelTuple = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t>;

struct DecodeLayer {
  at::Tensor input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w;  // weights: fp32, fp16 or int8
  c10::optional<at::Tensor> qkv_b, q_norm, k_norm, o_b, gate_up_b, down_b;
  // This layer's KV pool [pool_size, num_kv_heads, head_dim]: fp32, bf16, fp8 or int8 (read and
  // written in place, quantized as the module forward's store_kv does); an int8 pool's per-(slot,
  // KV head) scales [pool_size, num_kv_heads] fp32 beside it.
  at::Tensor k_buf, v_buf;
  c10::optional<at::Tensor> k_scale, v_scale;
  // Per-output-row fp32 scales of the int8 weights (--quantization w8a8_int8); unset otherwise.
  c10::optional<at::Tensor> qkv_s, o_s, gate_up_s, down_s;
  // Weight-only quantized forms (GGUF, GPTQ/AWQ, int4/int8 weight-only): when set, the linear runs
  // linear_wq over them instead of reading its dense weight.
  std::optional<WqForm> qkv_wq, o_wq, gate_up_wq, down_wq;
  LayerLora lora;  // LoRA adapters' slot buffers per projection (set_layer_lora); empty without
  // A MoE layer's sparse MLP (set_layer_moe, decode_moe.h): replaces the dense MLP, whose slot then
  // holds the shared expert (or nothing).
  std::optional<DecodeMoe> moe;
};

class DecodeModel {
 public:
  DecodeModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scaling,
              at::Tensor cos, at::Tensor sin);

  void add_layer(at::Tensor input_norm, at::Tensor qkv_w, c10::optional<at::Tensor> qkv_b,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, at::Tensor o_w,
                 c10::optional<at::Tensor> o_b, at::Tensor post_norm, at::Tensor gate_up_w,
                 c10::optional<at::Tensor> gate_up_b, at::Tensor down_w, c10::optional<at::Tensor> down_b,
                 at::Tensor k_buf, at::Tensor v_buf);
  // The per-(slot, KV head) scales of layer `index`'s int8 KV pool (fp32 [pool_size, num_kv_heads]
  // each); an int8 pool needs them, other dtypes refuse them.
  void set_layer_kv_scales(int64_t index, at::Tensor k_scale, at::Tensor v_scale);
  // The scales of layer `index`'s int8 weights (linear_int8's w_scale); every int8 weight needs one.
  void set_layer_scales(int64_t index, c10::optional<at::Tensor> qkv_s, c10::optional<at::Tensor> o_s,
                        c10::optional<at::Tensor> gate_up_s, c10::optional<at::Tensor> down_s);
  // The weight-only quantized forms of layer `index`'s linears (None: that linear reads its dense
  // weight). Each must dequantize to the shape of the dense weight add_layer was given (which
  // must not be int8); checked here by running it once.
  void set_layer_wq(int64_t index, std::optional<WqTuple> qkv, std::optional<WqTuple> o,
                    std::optional<WqTuple> gate_up, std::optional<WqTuple> down);
  // Which of layer `index`'s wq forms (set_layer_wq) take int8 activations (linear_wq_a8) at
  // batches of at most wq_a8_max_tokens rows; each marked one must exist and have groups that are
  // multiples of 32 inputs.
  void set_layer_wq_a8(int64_t index, bool qkv, bool o, bool gate_up, bool down);
  // The 8-row panels (linear_wq_a8_packed) of layer `index`'s marked wq forms (set_layer_wq_a8,
  // called first; None: that form keeps the row kernel); each is checked by running it once.
  void set_layer_wq_a8_panels(int64_t index, std::optional<PanelTuple> qkv, std::optional<PanelTuple> o,
                              std::optional<PanelTuple> gate_up, std::optional<PanelTuple> down);
  // The largest batch whose marked wq linears run linear_wq_a8 (0: none, every wq linear exact).
  void set_wq_a8_max_tokens(int64_t max_tokens);
  // Batches of more than `wq_max_tokens` rows run every wq form on int8 activations over its
  // panels (the module forward's Crossovers.wq_batch_a8, group_quant.wq_kernel); rows in
  // (wq_a8_max_tokens, wq_max_tokens] keep exact linear_wq. Called after every layer's forms and
  // panels: each linear of each layer must be a marked wq form with panels (else the module
  // forward runs oneDNN at those rows, which this stack does not). wq_max_tokens 0: off.
  void set_wq_batch_a8(int64_t wq_max_tokens);
  // LoRA: layer `index`'s adapted parts of each projection, each (a, b, column offset) over the LoRA
  // pool's slot buffers (decode_lora.h); every part of every layer has the same `num_slots`.
  void set_layer_lora(int64_t index, int64_t num_slots, std::vector<LoraPartTuple> qkv,
                      std::vector<LoraPartTuple> o, std::vector<LoraPartTuple> gate_up,
                      std::vector<LoraPartTuple> down);
  // Layer `index`'s MLP is a MoE block (decode_moe.h): router [E, hidden] fp32, top-k (renormalised
  // or not), every expert's stacked panels per projection; `shared`: the dense MLP add_layer was given
  // is its shared expert (else empty [0, hidden] / [hidden, 0] weights), scaled by sigmoid of
  // shared_gate_w [1, hidden] where given. One rank, no LoRA on that layer.
  void set_layer_moe(int64_t index, at::Tensor router_w, int64_t top_k, bool renormalize, ExpertPanelTuple w13,
                     ExpertPanelTuple w2, bool shared, c10::optional<at::Tensor> shared_gate_w);
  void set_final_norm(at::Tensor weight);
  // Tensor parallelism: with a communicator the layers hold this rank's shards (the constructor's
  // head counts are per rank, o_w/down_w are row shards [hidden, in / world]); the o_proj and
  // down_proj outputs are all-reduced before the residual add and their biases added once after.
  // nullptr (None) is the single-rank path.
  void set_tp_comm(std::shared_ptr<ShmComm> comm);

  // hidden [bs, hidden_size] (the token embeddings) -> final normed hidden [bs, hidden_size]; writes
  // this step's K/V at out_cache_loc, attends over req_to_token[req_pool_indices, :seq_lens].
  // token_slots int64 [bs] (LoRA only): each row's adapter slot, -1 for the base model.
  // should_yield (one rank only: peers would stop at different layers): asked before each layer;
  // true stops the step and returns an undefined tensor (None in Python), having written only the
  // K/V of the layers that ran (the step runs again later and writes them again).
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                     const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                     const c10::optional<at::Tensor>& token_slots = c10::nullopt,
                     const std::function<bool()>& should_yield = nullptr) const;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scaling_;
  at::Tensor cos_, sin_;  // [max_position, head_dim / 2]
  std::vector<DecodeLayer> layers_;
  at::Tensor final_norm_;
  std::shared_ptr<ShmComm> tp_comm_;
  int64_t lora_slots_ = 0;  // the LoRA pool's slot count; 0: no layer has LoRA parts
  int64_t wq_a8_max_tokens_ = 0;  // set_wq_a8_max_tokens
  int64_t wq_batch_a8_above_ = 0;  // set_wq_batch_a8 (0: off)

  // x @ w.T (+ its LoRA delta) summed over the ranks (+ b once): a row-parallel linear; on one
  // rank plain lin() (+ the delta). `plan` null: no adapted row this step; `a8`: this step's rows
  // are few enough for int8 activations (wq_a8_max_tokens_).
  // A MoE layer's block output for normed x (decode_moe.h; the shared expert on the dense slot).
  at::Tensor moe_block(const DecodeLayer& L, const at::Tensor& x, bool a8) const;
  at::Tensor row_parallel(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& s,
                          const std::optional<WqForm>& wq, const c10::optional<at::Tensor>& b,
                          const std::vector<LoraPart>& lora, const LoraPlan* plan, bool a8) const;
};
