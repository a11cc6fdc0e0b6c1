// Python bindings of the CPU kernels (module sgl_kernel._cpu).
#include <torch/extension.h>

#include <pybind11/functional.h>  // should_yield: a Python callable as std::function

#include "common.h"
#include "decode_model.h"
#include "decode_timers.h"
#include "linear_wq_a8.h"
#include "ops.h"
#include "shm_comm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "radixserve CPU kernels";
  m.def("decode_attention", &decode_attention,
        "Paged decode attention over the token pool, in place (q/out [bs,H,D] fp32; K/V fp32, bf16, fp8 "
        "e4m3fn/e5m2, or int8 with k_scale/v_scale fp32 [N,Hkv])",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("out"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("extend_attention", &extend_attention,
        "Paged causal extend (prefill) attention over the token pool (q [T,H,D], out [T,H*D] fp32); "
        "tree_mask: optional uint8 [sum(extend_lens^2)] mask among each request's new tokens (draft trees)",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("out"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("extend_lens"), py::arg("scale"),
        py::arg("tree_mask") = py::none(), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.attr("extend_attention_tree_mask") = true;  // this build takes tree_mask
  // The KV pool dtypes decode_attention and extend_attention read (int8 with per-row scales).
  m.attr("attention_kv_dtypes") = py::make_tuple("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8");
  // Which vector path extend_attention was compiled with ("none": it raises, use torch).
  m.attr("extend_attention_isa") = RS_HAVE_AVX512 ? "avx512" : RS_HAVE_AVX2 ? "avx2" : "none";
  // Whether bf16 pools run extend_attention's bf16-dot tiles (RS_HAVE_EXTEND_BF16 of
  // extend_attention_bf16.h: Q and P rounded to bf16) rather than the fp32 ones.
// Likewise decode_attention's block step (RS_HAVE_DECODE_BF16 of attention_block_bf16.h), for
// head_dim a multiple of 32.
#if RS_HAVE_AVX512 && defined(__AVX512BF16__)
  m.attr("extend_attention_bf16_dot") = true;
  m.attr("decode_attention_bf16_dot") = true;
#else
  m.attr("extend_attention_bf16_dot") = false;
  m.attr("decode_attention_bf16_dot") = false;
#endif
  m.def("linear_f16", &linear_f16, "y = x @ w.T (+ bias): x fp32 [M,K], w fp16 [N,K], fp32 math",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_f32", &linear_f32, "y = x @ w.T (+ bias) for small M: x, w fp32",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_int8", &linear_int8,
        "W8A8: x fp32 [M,K] quantized per row to int8, w int8 [N,K] with per-row scales w_scale fp32 [N]; "
        "int32 dot products, y fp32 [M,N]. isa: 0 best, 1 scalar, 2 avx2, 3 avx512 (VNNI)",
        py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("bias") = py::none(), py::arg("isa") = 0);
  // The paths linear_int8 can run here, for tests and benchmarks ("scalar" always).
  py::list int8_isas;
  for (const std::string& isa : linear_int8_isas()) int8_isas.append(isa);
  m.attr("linear_int8_isas") = int8_isas;
  m.def("linear_wq", &linear_wq,
        "Weight-only group-quantized linear: x fp32 [M,K]; qweight int8 [N,K] (bits 8) or uint8 [N,K/2] "
        "(bits 4, low nibble first); scales / offsets fp32 [N, K/group_size] (or both fp16, widened exactly): "
        "w = q*scale (+offset); fp32 math. "
        "isa: 0 best, 1 scalar, 2 avx2, 3 avx512",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
        py::arg("group_size"), py::arg("bias") = py::none(), py::arg("isa") = 0);
  py::list wq_isas;
  for (const std::string& isa : linear_wq_isas()) wq_isas.append(isa);
  m.attr("linear_wq_isas") = wq_isas;
  // linear_wq takes fp16 scales and offsets (widened exactly): callers may narrow GGUF's d and m.
  m.attr("linear_wq_half_groups") = true;
  m.def("linear_wq_a8", &linear_wq_a8,
        "linear_wq with x quantized to int8 per block of 32 inputs (scale amax/127, round half to even) and "
        "int32 block dot products; group_size a multiple of 32. isa: 0 best, 1 scalar, 2 avx2, 3 avx512 (VNNI)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
        py::arg("group_size"), py::arg("bias") = py::none(), py::arg("isa") = 0);
  py::list wq_a8_isas;
  for (const std::string& isa : linear_wq_a8_isas()) wq_a8_isas.append(isa);
  m.attr("linear_wq_a8_isas") = wq_a8_isas;
  m.def("linear_wq_a8_packed", &linear_wq_a8_packed,
        "linear_wq_a8 on a weight repacked into panels of 8 output rows (sgl_kernel.cpu.pack_wq_a8): packed_q "
        "[ceil(n/8), K/32, 128 (bits 4) or 256 (bits 8)], packed scales / offsets fp32 or fp16 [ceil(n/8), groups, "
        "8]; zero_point (bits 4, no offsets): w = scale * (q - zero_point); isa: 0 best, 2 avx2, 3 avx512 (VNNI)",
        py::arg("x"), py::arg("packed_q"), py::arg("packed_scales"), py::arg("packed_offsets"), py::arg("n"),
        py::arg("bits"), py::arg("group_size"), py::arg("bias") = py::none(), py::arg("zero_point") = 0,
        py::arg("isa") = 0);
  m.attr("linear_wq_a8_packed_available") = linear_wq_a8_packed_available();
  m.def("moe_wq_a8_packed", &moe_wq_a8_packed,
        "A MoE layer's routed experts on int8 activations: x fp32 [T,H], topk_ids int64 / topk_weights fp32 "
        "[T,top_k]; w13 (gate then up) and w2 (down) as pack_wq_a8 panels stacked over the experts; isa: 0 best, "
        "2 avx2, 3 avx512 (VNNI)",
        py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("w13_q"), py::arg("w13_scales"),
        py::arg("w13_offsets"), py::arg("w13_bits"), py::arg("w13_group_size"), py::arg("w2_q"),
        py::arg("w2_scales"), py::arg("w2_offsets"), py::arg("w2_bits"), py::arg("w2_group_size"),
        py::arg("w13_zero_point") = 0, py::arg("w2_zero_point") = 0, py::arg("isa") = 0);
  m.def("greedy_head_candidates", &greedy_head_candidates,
        "Greedy LM head: per row of x fp32 [M,K], the rows of the int8 head copy u [N,K] (stats fp32 [N,3]: "
        "scale, error norm, norm) that may hold its argmax: (indices int64 [C], counts int64 [M], -1 = none proven). "
        "isa: 0 best, 1 scalar, 2 avx2, 3 avx512",
        py::arg("x"), py::arg("u"), py::arg("stats"), py::arg("umax"), py::arg("isa") = 0);
  py::list gh_isas;
  for (const std::string& isa : greedy_head_isas()) gh_isas.append(isa);
  m.attr("greedy_head_isas") = gh_isas;
  m.def("lora_delta_", &lora_delta_,
        "In place: out[t] += (x[t] @ a[s]^T) @ b[s] for rows t with slot s = token_slots[t] >= 0; x/out fp32 or "
        "bf16 [n, in]/[n, out] (rows contiguous), a [slots, rank, in], b [slots, rank, out] fp32 or bf16, "
        "token_slots int64 [n] (-1: untouched)",
        py::arg("x"), py::arg("a"), py::arg("b"), py::arg("token_slots"), py::arg("out"));
  m.def("decode_model_timers", &decode_timers::read, py::arg("reset") = false,
        "DecodeModel.forward's wall ns per part (norm, qkv, rope_kv, attention, o, gate_up, act, down, other) "
        "and the forwards counted; zeros unless RADIXSERVE_DECODE_TIMERS=1 at load");
  m.def("step_team_stats", &rs::step_team_stats,
        "The decode step team (thread_pool.h): [steps that held it, regions run on it, chunks its workers ran, "
        "its size]");
  m.def("step_team_enter", &rs::step_team_enter,
        "Holds the decode step team on this thread until step_team_exit (the fused stack and the LM head then "
        "share one scope); returns whether it took the team");
  m.def("step_team_exit", &rs::step_team_exit, "Releases what step_team_enter took on this thread");
  m.def("step_team_probe", &rs::step_team_probe, py::arg("n"), py::arg("grain"), py::arg("throw_at") = -1,
        "Test hook: rs::parallel_for(0, n, grain) inside a step team, the chunk holding throw_at raising; "
        "returns the chunks run, sorted",
        py::call_guard<py::gil_scoped_release>());
  m.def("rmsnorm", &rmsnorm, "RMSNorm of each row: x [M,N] fp32, w [N]");
  m.def("fused_add_rmsnorm_", &fused_add_rmsnorm_, "In place: residual += x; x = rmsnorm(residual)");
  m.def("rotary_neox_", &rotary_neox_, "Neox rotary in place on q [T,H,D] and k [T,Hkv,D]");
  m.def("silu_and_mul", &silu_and_mul, "x [M, 2d] -> silu(x[:, :d]) * x[:, d:]");
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(x, dim=-1) of x fp32 [rows, n] with contiguous rows (first index of the maximum, NaN the "
        "greatest): int64 [rows]");
  m.def("argmax_rows_checked", &argmax_rows_checked,
        "argmax_rows(x) and, per row, whether x[row, argmax] is not finite: (int64 [rows], bool [rows])");
  m.def("store_kv", &store_kv,
        "k_buf[loc] = k; v_buf[loc] = v (k/v fp32); bf16/fp8/int8 pools quantize each row (int8: scales into "
        "k_scale/v_scale fp32 [N,Hkv])",
        py::arg("k_buf"), py::arg("v_buf"), py::arg("loc"), py::arg("k"), py::arg("v"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.attr("store_kv_quantizes") = true;  // this build's store_kv writes every attention_kv_dtypes pool
  // Held by shared_ptr so a DecodeModel can keep the communicator it all-reduces with. The waits
  // release the GIL: a peer may be milliseconds behind, and other Python threads should run.
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<ShmComm, std::shared_ptr<ShmComm>>(m, "ShmComm", "Collectives over a shared-memory region (one host)")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, double>(), py::arg("path"), py::arg("rank"),
           py::arg("world_size"), py::arg("slot_bytes"), py::arg("create"), py::arg("timeout_s"))
      .def("all_reduce_", &ShmComm::all_reduce_, py::arg("tensor"), nogil(),
           "In place SUM of a contiguous fp32/bf16 tensor; bit-identical on every rank")
      .def("all_gather", &ShmComm::all_gather, py::arg("input"), nogil(),
           "input [..., n] -> [..., world_size * n], rank r's input at columns [r*n, (r+1)*n)")
      .def("barrier", &ShmComm::barrier, nogil())
      .def("close", &ShmComm::close)
      .def("peers_visible", &ShmComm::peers_visible,
           "Every peer's process is visible here (same PID namespace): dead-peer checks can work")
      .def_property("check_peer_pids", &ShmComm::check_peer_pids, &ShmComm::set_check_peer_pids)
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("world_size", &ShmComm::world_size)
      .def_property_readonly("slot_bytes", &ShmComm::slot_bytes)
      .def_property_readonly("seq", &ShmComm::seq)
      .def_property_readonly("closed", &ShmComm::closed)
      .def_property("timeout_s", &ShmComm::timeout_s, &ShmComm::set_timeout_s)
      .def_static("region_bytes", &ShmComm::region_bytes, py::arg("world_size"), py::arg("slot_bytes"));
  py::class_<DecodeModel>(m, "DecodeModel", "A Llama-family decoder stack run by one call per decode step")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("scaling"),
           py::arg("cos"), py::arg("sin"))
      .def("add_layer", &DecodeModel::add_layer)
      .def("set_layer_kv_scales", &DecodeModel::set_layer_kv_scales, py::arg("index"), py::arg("k_scale"),
           py::arg("v_scale"),
           "An int8 KV pool's per-(slot, KV head) scales for a layer (fp32 [pool_size, num_kv_heads]); a build with "
           "this method takes every attention_kv_dtypes pool in add_layer")
      .def("set_layer_scales", &DecodeModel::set_layer_scales, py::arg("index"), py::arg("qkv_s"), py::arg("o_s"),
           py::arg("gate_up_s"), py::arg("down_s"), "Per-row fp32 scales of a layer's int8 weights (None: not int8)")
      .def("set_layer_wq", &DecodeModel::set_layer_wq, py::arg("index"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"),
           "Weight-only quantized forms of a layer's linears, each (qweight, scales, offsets, bits, group_size) "
           "as linear_wq takes them, or None (that linear reads its dense weight)")
      .def("set_layer_wq_a8", &DecodeModel::set_layer_wq_a8, py::arg("index"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"),
           "Which of a layer's wq forms (set_layer_wq, called first) take int8 activations (linear_wq_a8) at "
           "batches of at most wq_a8_max_tokens rows")
      .def("set_layer_wq_a8_panels", &DecodeModel::set_layer_wq_a8_panels, py::arg("index"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"),
           "The 8-row panels (q, scales, offsets, zero_point) of a layer's marked wq forms (set_layer_wq_a8 first), or None: "
           "their int8-activation products run linear_wq_a8_packed")
      .def("set_wq_a8_max_tokens", &DecodeModel::set_wq_a8_max_tokens, py::arg("max_tokens"),
           "The largest batch whose marked wq linears run linear_wq_a8 (0: every wq linear keeps fp32 activations)")
      .def("set_wq_batch_a8", &DecodeModel::set_wq_batch_a8, py::arg("wq_max_tokens"),
           "Batches above wq_max_tokens run every wq form on int8 activations over its panels (each layer's four "
           "linears must be marked wq forms with panels; 0: off)")
      .def("set_layer_lora", &DecodeModel::set_layer_lora, py::arg("index"), py::arg("num_slots"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"),
           "LoRA slot buffers of a layer's projections: per projection a list of (a [slots, rank, in], "
           "b [slots, rank, width], output column offset), read in place at every forward with token_slots")
      .def("set_layer_moe", &DecodeModel::set_layer_moe, py::arg("index"), py::arg("router_w"), py::arg("top_k"),
           py::arg("renormalize"), py::arg("w13"), py::arg("w2"), py::arg("shared"), py::arg("shared_gate_w"),
           "A layer's MLP as a MoE block: router [E, hidden] fp32, softmax top-k, the experts' stacked panels per "
           "projection (q, scales, offsets, bits, group_size, zero_point) through moe_wq_a8_packed; shared: the "
           "dense MLP given to add_layer is the shared expert (gated by shared_gate_w [1, hidden] where given)")
      .def("set_final_norm", &DecodeModel::set_final_norm)
      .def("set_tp_comm", &DecodeModel::set_tp_comm, py::arg("comm"),
           "All-reduce o_proj/down_proj outputs over this ShmComm (the layers hold the rank's shards); None: one rank")
      // Without the GIL: with a communicator the call may wait for a slower peer rank, and the
      // overlap loop's scheduler thread should keep working meanwhile (the call touches no Python).
      .def("forward", &DecodeModel::forward, py::arg("hidden"), py::arg("positions"), py::arg("out_cache_loc"),
           py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"),
           py::arg("token_slots") = py::none(), py::arg("should_yield") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
