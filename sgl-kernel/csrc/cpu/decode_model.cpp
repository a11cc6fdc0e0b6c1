#include "decode_model.h"

#include "common.h"

#include "decode_kv_prefetch.h"
#include "decode_timers.h"
#include "linear_wq_a8.h"
#include "ops.h"

namespace {

// x [M, K] @ w.T (+ b) with the small-M kernel that matches the weight's storage; `s` holds the
// per-row scales of an int8 weight, `wq` a weight-only quantized form (read instead of w), which
// takes int8 activations when it is marked so and `a8` says the step is small enough: the same
// rule, and so the same kernel and bits, as layers/group_quant.py's linear_wq on the module forward.
at::Tensor lin(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& s,
               const std::optional<WqForm>& wq, const c10::optional<at::Tensor>& b, bool a8) {
  if (wq.has_value() && a8 && wq->int8_activations) {
    if (wq->panel_q.has_value())
      return linear_wq_a8_packed(x, *wq->panel_q, *wq->panel_scales, wq->panel_offsets, wq->qweight.size(0),
                                 wq->bits, wq->group_size, b, wq->panel_zero_point);
    return linear_wq_a8(x, wq->qweight, wq->scales, wq->offsets, wq->bits, wq->group_size, b, 0);
  }
  if (wq.has_value()) return linear_wq(x, wq->qweight, wq->scales, wq->offsets, wq->bits, wq->group_size, b, 0);
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(s.has_value(), "DecodeModel: an int8 weight needs its scales (set_layer_scales)");
    return linear_int8(x, w, *s, b, 0);
  }
  return w.scalar_type() == at::kHalf ? linear_f16(x, w, b) : linear_f32(x, w, b);
}

// Per-head RMSNorm of a [M, heads, D] view (Qwen3's q/k norm); returns a contiguous tensor.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto sizes = x.sizes().vec();
  return rmsnorm(x.contiguous().view({-1, x.size(2)}), w, eps).view(sizes);
}

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kChar),
              "DecodeModel: ", name, " must be a contiguous fp32/fp16/int8 [", rows, ", ", cols, "]");
}

void check_scale(const c10::optional<at::Tensor>& s, const at::Tensor& w, const char* name) {
  if (w.scalar_type() != at::kChar) {
    TORCH_CHECK(!s.has_value(), "DecodeModel: ", name, " has scales but its weight is not int8");
    return;
  }
  TORCH_CHECK(s.has_value() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == w.size(0),
              "DecodeModel: ", name, " needs contiguous fp32 scales [", w.size(0), "]");
}

// A wq form for dense weight w, checked by running it once on a zero row (linear_wq validates
// dtypes, layouts and group shapes; the output's width is w's row count).
std::optional<WqForm> wq_form(std::optional<WqTuple> t, const at::Tensor& w, const char* name) {
  if (!t.has_value()) return std::nullopt;
  TORCH_CHECK(w.scalar_type() != at::kChar, "DecodeModel: ", name, " is int8 (w8a8) and cannot also be wq");
  auto [qweight, scales, offsets, bits, group_size] = std::move(*t);
  WqForm f{std::move(qweight), std::move(scales), std::move(offsets), bits, group_size};
  const at::Tensor y = linear_wq(at::zeros({1, w.size(1)}, w.options().dtype(at::kFloat)), f.qweight, f.scales,
                                 f.offsets, f.bits, f.group_size, c10::nullopt, 0);
  TORCH_CHECK(y.size(1) == w.size(0), "DecodeModel: ", name, "'s wq form has ", y.size(1), " rows, its weight ",
              w.size(0));
  return f;
}

}  // namespace

DecodeModel::DecodeModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps,
                         double scaling, at::Tensor cos, at::Tensor sin)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(rms_norm_eps),
      scaling_(scaling), cos_(std::move(cos)), sin_(std::move(sin)) {
  TORCH_CHECK(num_heads % num_kv_heads == 0, "DecodeModel: num_heads % num_kv_heads != 0");
}

void DecodeModel::add_layer(at::Tensor input_norm, at::Tensor qkv_w, c10::optional<at::Tensor> qkv_b,
                            c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, at::Tensor o_w,
                            c10::optional<at::Tensor> o_b, at::Tensor post_norm, at::Tensor gate_up_w,
                            c10::optional<at::Tensor> gate_up_b, at::Tensor down_w,
                            c10::optional<at::Tensor> down_b, at::Tensor k_buf, at::Tensor v_buf) {
  const int64_t hidden = input_norm.numel(), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  check_weight(qkv_w, q_size + 2 * kv_size, hidden, "qkv_w");
  check_weight(o_w, hidden, q_size, "o_w");
  TORCH_CHECK(gate_up_w.dim() == 2 && gate_up_w.size(0) % 2 == 0, "DecodeModel: gate_up_w must be [2 * I, H]");
  check_weight(gate_up_w, gate_up_w.size(0), hidden, "gate_up_w");
  check_weight(down_w, hidden, gate_up_w.size(0) / 2, "down_w");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeModel: q_norm and k_norm come together");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.size(1) == num_kv_heads_ && k_buf.size(2) == head_dim_ &&
                  k_buf.sizes() == v_buf.sizes() && k_buf.scalar_type() == v_buf.scalar_type(),
              "DecodeModel: KV buffers must be [pool_size, num_kv_heads, head_dim] of one dtype");
  // Any pool dtype the attention kernels read (an int8 pool's scales come by set_layer_kv_scales).
  dispatch_kv_dtype(k_buf.scalar_type(), "DecodeModel", [](auto) {});
  layers_.push_back(DecodeLayer{input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w, qkv_b, q_norm, k_norm, o_b,
                                gate_up_b, down_b, k_buf, v_buf});
}

void DecodeModel::set_layer_kv_scales(int64_t index, at::Tensor k_scale, at::Tensor v_scale) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  kv_scales("DecodeModel", L.k_buf, k_scale, v_scale);  // int8 pools only, [pool_size, Hkv] fp32
  L.k_scale = std::move(k_scale);
  L.v_scale = std::move(v_scale);
}

void DecodeModel::set_layer_scales(int64_t index, c10::optional<at::Tensor> qkv_s, c10::optional<at::Tensor> o_s,
                                   c10::optional<at::Tensor> gate_up_s, c10::optional<at::Tensor> down_s) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  check_scale(qkv_s, L.qkv_w, "qkv_w");
  check_scale(o_s, L.o_w, "o_w");
  check_scale(gate_up_s, L.gate_up_w, "gate_up_w");
  check_scale(down_s, L.down_w, "down_w");
  L.qkv_s = std::move(qkv_s);
  L.o_s = std::move(o_s);
  L.gate_up_s = std::move(gate_up_s);
  L.down_s = std::move(down_s);
}

void DecodeModel::set_layer_wq(int64_t index, std::optional<WqTuple> qkv, std::optional<WqTuple> o,
                               std::optional<WqTuple> gate_up, std::optional<WqTuple> down) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  // Build all four before storing any: a bad one leaves the layer as it was.
  auto qkv_wq = wq_form(std::move(qkv), L.qkv_w, "qkv_w");
  auto o_wq = wq_form(std::move(o), L.o_w, "o_w");
  auto gate_up_wq = wq_form(std::move(gate_up), L.gate_up_w, "gate_up_w");
  auto down_wq = wq_form(std::move(down), L.down_w, "down_w");
  L.qkv_wq = std::move(qkv_wq);
  L.o_wq = std::move(o_wq);
  L.gate_up_wq = std::move(gate_up_wq);
  L.down_wq = std::move(down_wq);
}

void DecodeModel::set_layer_wq_a8(int64_t index, bool qkv, bool o, bool gate_up, bool down) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  std::optional<WqForm>* forms[] = {&L.qkv_wq, &L.o_wq, &L.gate_up_wq, &L.down_wq};
  const bool marks[] = {qkv, o, gate_up, down};
  const char* names[] = {"qkv_w", "o_w", "gate_up_w", "down_w"};
  // Check all four before marking any: a bad one leaves the layer as it was.
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK(!marks[i] || (forms[i]->has_value() && (*forms[i])->group_size % 32 == 0), "DecodeModel: layer ",
                index, "'s ", names[i], " has no wq form with groups of a multiple of 32 inputs for int8 activations");
  for (int i = 0; i < 4; ++i)
    if (forms[i]->has_value()) (*forms[i])->int8_activations = marks[i];
}

void DecodeModel::set_layer_wq_a8_panels(int64_t index, std::optional<PanelTuple> qkv, std::optional<PanelTuple> o,
                                         std::optional<PanelTuple> gate_up, std::optional<PanelTuple> down) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  std::optional<WqForm>* forms[] = {&L.qkv_wq, &L.o_wq, &L.gate_up_wq, &L.down_wq};
  std::optional<PanelTuple>* panels[] = {&qkv, &o, &gate_up, &down};
  const char* names[] = {"qkv_w", "o_w", "gate_up_w", "down_w"};
  // Check all four before storing any: a bad one leaves the layer as it was. Running each once on
  // a zero row lets linear_wq_a8_packed validate the layout against the form's shape.
  for (int i = 0; i < 4; ++i) {
    if (!panels[i]->has_value()) continue;
    TORCH_CHECK(forms[i]->has_value() && (*forms[i])->int8_activations, "DecodeModel: layer ", index, "'s ",
                names[i], " has panels but no wq form marked for int8 activations (set_layer_wq_a8 first)");
    const WqForm& f = **forms[i];
    const auto& [q, s, off, zero] = **panels[i];
    const at::Tensor x0 = at::zeros({1, f.qweight.size(1) * (f.bits == 4 ? 2 : 1)}, s.options().dtype(at::kFloat));
    const at::Tensor y =
        linear_wq_a8_packed(x0, q, s, off, f.qweight.size(0), f.bits, f.group_size, c10::nullopt, zero);
    TORCH_CHECK(y.size(1) == f.qweight.size(0), "DecodeModel: layer ", index, "'s ", names[i], " panels give ",
                y.size(1), " rows, its form ", f.qweight.size(0));
  }
  for (int i = 0; i < 4; ++i) {
    if (!panels[i]->has_value()) continue;
    auto& [q, s, off, zero] = **panels[i];
    WqForm& f = **forms[i];
    f.panel_q = std::move(q);
    f.panel_scales = std::move(s);
    f.panel_offsets = std::move(off);
    f.panel_zero_point = zero;
  }
}

void DecodeModel::set_wq_a8_max_tokens(int64_t max_tokens) {
  TORCH_CHECK(max_tokens >= 0, "DecodeModel: wq_a8_max_tokens must be >= 0, got ", max_tokens);
  wq_a8_max_tokens_ = max_tokens;
}

void DecodeModel::set_wq_batch_a8(int64_t wq_max_tokens) {
  TORCH_CHECK(wq_max_tokens >= 0, "DecodeModel: wq_max_tokens must be >= 0, got ", wq_max_tokens);
  const char* names[] = {"qkv_w", "o_w", "gate_up_w", "down_w"};
  for (size_t i = 0; wq_max_tokens > 0 && i < layers_.size(); ++i) {
    const DecodeLayer& L = layers_[i];
    const std::optional<WqForm>* forms[] = {&L.qkv_wq, &L.o_wq, &L.gate_up_wq, &L.down_wq};
    for (int j = 0; j < 4; ++j)
      TORCH_CHECK(forms[j]->has_value() && (*forms[j])->int8_activations && (*forms[j])->panel_q.has_value(),
                  "DecodeModel: layer ", i, "'s ", names[j],
                  " has no marked wq form with panels, which batches on int8 activations need");
  }
  wq_batch_a8_above_ = wq_max_tokens;
}

void DecodeModel::set_layer_lora(int64_t index, int64_t num_slots, std::vector<LoraPartTuple> qkv,
                                 std::vector<LoraPartTuple> o, std::vector<LoraPartTuple> gate_up,
                                 std::vector<LoraPartTuple> down) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  TORCH_CHECK(num_slots > 0 && (lora_slots_ == 0 || lora_slots_ == num_slots), "DecodeModel: LoRA with ", num_slots,
              " slots, other layers have ", lora_slots_);
  DecodeLayer& L = layers_[index];
  const int64_t hidden = L.input_norm.numel();
  // Check all four before storing any: a bad one leaves the layer as it was.
  LayerLora lora{lora_parts(std::move(qkv), hidden, L.qkv_w.size(0), num_slots, "qkv_proj"),
                 lora_parts(std::move(o), L.o_w.size(1), hidden, num_slots, "o_proj"),
                 lora_parts(std::move(gate_up), hidden, L.gate_up_w.size(0), num_slots, "gate_up_proj"),
                 lora_parts(std::move(down), L.down_w.size(1), hidden, num_slots, "down_proj")};
  L.lora = std::move(lora);
  lora_slots_ = num_slots;
}

void DecodeModel::set_layer_moe(int64_t index, at::Tensor router_w, int64_t top_k, bool renormalize,
                                ExpertPanelTuple w13, ExpertPanelTuple w2, bool shared,
                                c10::optional<at::Tensor> shared_gate_w) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "DecodeModel: no layer ", index);
  DecodeLayer& L = layers_[index];
  TORCH_CHECK(router_w.dim() == 2 && router_w.size(1) == L.input_norm.numel() && shared == (L.gate_up_w.size(0) > 0),
              "DecodeModel: layer ", index,
              "'s router must be [E, hidden] and its dense MLP the shared expert or empty");
  L.moe = make_decode_moe(std::move(router_w), top_k, renormalize, std::move(w13), std::move(w2), shared,
                          std::move(shared_gate_w));
}

at::Tensor DecodeModel::moe_block(const DecodeLayer& L, const at::Tensor& x, bool a8) const {
  TORCH_CHECK(!tp_comm_, "DecodeModel: MoE layers run on one rank only");
  at::Tensor out = decode_moe_routed(*L.moe, x);
  if (!L.moe->shared) return out;
  const at::Tensor gate_up = lin(x, L.gate_up_w, L.gate_up_s, L.gate_up_wq, L.gate_up_b, a8);
  const at::Tensor shared = lin(silu_and_mul(gate_up), L.down_w, L.down_s, L.down_wq, L.down_b, a8);
  return decode_moe_add_shared(*L.moe, x, std::move(out), shared);
}

void DecodeModel::set_final_norm(at::Tensor weight) { final_norm_ = std::move(weight); }

void DecodeModel::set_tp_comm(std::shared_ptr<ShmComm> comm) { tp_comm_ = std::move(comm); }

at::Tensor DecodeModel::row_parallel(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& s,
                                     const std::optional<WqForm>& wq, const c10::optional<at::Tensor>& b,
                                     const std::vector<LoraPart>& lora, const LoraPlan* plan, bool a8) const {
  // [bs, hidden]: this rank's partial sum (the whole output on one rank, bias included)
  at::Tensor y = lin(x, w, s, wq, tp_comm_ ? c10::nullopt : b, a8);
  if (plan != nullptr) add_lora(lora, x, y, *plan);  // a partial sum too: before the all-reduce
  if (!tp_comm_) return y;
  tp_comm_->all_reduce_(y);
  if (b.has_value()) y.add_(*b);
  return y;
}

at::Tensor DecodeModel::forward(const at::Tensor& hidden, const at::Tensor& positions,
                                const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                                const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                const c10::optional<at::Tensor>& token_slots,
                                const std::function<bool()>& should_yield) const {
  TORCH_CHECK(!layers_.empty() && final_norm_.defined(), "DecodeModel: layers or final norm missing");
  // The step's parallel loops run on the step team (thread_pool.h), which stays hot between them.
  const rs::StepTeam step_team;
  for (const DecodeLayer& L : layers_)
    TORCH_CHECK(L.k_buf.scalar_type() != at::kChar || L.k_scale.has_value(),
                "DecodeModel: an int8 KV pool needs its scales (set_layer_kv_scales)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "DecodeModel: hidden must be fp32 [bs, H]");
  const int64_t bs = hidden.size(0), H = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
  // The rows' adapters, sorted once for every projection of every layer; none: the base model.
  LoraPlan lora_plan_storage;
  const LoraPlan* plan = nullptr;
  if (token_slots.has_value()) {
    TORCH_CHECK(lora_slots_ > 0, "DecodeModel: token_slots given but no layer has LoRA (set_layer_lora)");
    TORCH_CHECK(token_slots->numel() == bs, "DecodeModel: token_slots has ", token_slots->numel(),
                " rows, hidden ", bs);
    lora_plan_storage = lora_plan(*token_slots, lora_slots_);
    if (!lora_plan_storage.items.empty()) plan = &lora_plan_storage;
  }
  // The same chain as LlamaDecoderLayer: residual carries the sum, x the normed input of each block.
  decode_timers::Laps laps;  // inert unless RADIXSERVE_DECODE_TIMERS is set (decode_timers.h)
  at::Tensor residual = hidden.contiguous().clone();
  at::Tensor x = rmsnorm(residual, layers_[0].input_norm, eps_);
  at::Tensor attn_out = at::empty({bs, H, D}, hidden.options());  // [bs, num_heads, head_dim]
  // int8 activations for the marked wq forms this step: the small products' bound, or a batch
  // above wq_max_tokens where every form has panels (set_wq_batch_a8 checked that).
  const bool a8 = bs <= wq_a8_max_tokens_ || (wq_batch_a8_above_ > 0 && bs > wq_batch_a8_above_);
  const bool kv_prefetch = kv_prefetch_enabled() && bs <= kKvPrefetchMaxRows;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (should_yield && should_yield()) return at::Tensor();
    const DecodeLayer& L = layers_[i];
    if (i > 0) fused_add_rmsnorm_(x, residual, L.input_norm, eps_);
    laps.lap(i > 0 ? decode_timers::kNorm : decode_timers::kOther);
    // A few rows: their context's K/V on its way into L2 while qkv streams (decode_kv_prefetch.h).
    if (kv_prefetch) prefetch_kv_rows(L.k_buf, L.v_buf, req_to_token, req_pool_indices, seq_lens);
    at::Tensor qkv = lin(x, L.qkv_w, L.qkv_s, L.qkv_wq, L.qkv_b, a8);  // [bs, (H + 2 * Hkv) * D]
    if (plan != nullptr) add_lora(L.lora.qkv, x, qkv, *plan);
    laps.lap(decode_timers::kQkv);
    qkv = qkv.view({bs, H + 2 * Hkv, D});
    at::Tensor q = qkv.narrow(1, 0, H), k = qkv.narrow(1, H, Hkv);
    const at::Tensor v = qkv.narrow(1, H + Hkv, Hkv);
    if (L.q_norm.has_value()) {
      q = head_norm(q, *L.q_norm, eps_);
      k = head_norm(k, *L.k_norm, eps_);
    }
    rotary_neox_(positions, q, k, cos_, sin_);
    at::Tensor k_buf = L.k_buf, v_buf = L.v_buf;
    store_kv(k_buf, v_buf, out_cache_loc, k, v, L.k_scale, L.v_scale);  // quantized to the pool's dtype
    laps.lap(decode_timers::kRopeKv);
    decode_attention(q, k_buf, v_buf, attn_out, req_to_token, req_pool_indices, seq_lens, scaling_, L.k_scale,
                     L.v_scale);
    laps.lap(decode_timers::kAttention);
    x = row_parallel(attn_out.view({bs, H * D}), L.o_w, L.o_s, L.o_wq, L.o_b, L.lora.o, plan, a8);
    laps.lap(decode_timers::kO);
    fused_add_rmsnorm_(x, residual, L.post_norm, eps_);
    laps.lap(decode_timers::kNorm);
    if (L.moe.has_value()) {  // a MoE layer (set_layer_moe): no LoRA there, checked in Python
      x = moe_block(L, x, a8);
      laps.lap(decode_timers::kDown);  // the whole MoE block counts as the down projection's part
      continue;
    }
    at::Tensor gate_up = lin(x, L.gate_up_w, L.gate_up_s, L.gate_up_wq, L.gate_up_b, a8);  // [bs, 2 * I]
    if (plan != nullptr) add_lora(L.lora.gate_up, x, gate_up, *plan);
    laps.lap(decode_timers::kGateUp);
    const at::Tensor act = silu_and_mul(gate_up);
    laps.lap(decode_timers::kAct);
    x = row_parallel(act, L.down_w, L.down_s, L.down_wq, L.down_b, L.lora.down, plan, a8);
    laps.lap(decode_timers::kDown);
  }
  fused_add_rmsnorm_(x, residual, final_norm_, eps_);
  laps.lap(decode_timers::kOther);
  return x;
}
