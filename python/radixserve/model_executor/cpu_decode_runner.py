"""Small CPU decode batches in one compiled call: the CPU counterpart of a decode CUDA graph.

At one to a few tokens a decode step is bound by reading the weights, and the ~450 Python-level
ops of a 30-layer forward (module calls, views, kernel dispatch) cost ~1.5 ms on top of a
~7-13 ms step. `sgl_kernel.cpu.decode_model` runs the whole decoder stack in C++ over the same
tensors the Python path uses: the small-M linear kernels on the same weights (int8 ones with
their scales under --quantization w8a8_int8, weight-only group-quantized forms through linear_wq
where a layer has one, fp16 copies with --cpu-fp16-weights, else the plain fp32 ones), the same KV
pool in its own dtype (fp32, or --kv-cache-dtype's bf16 / fp8 / int8, quantized on write and
dequantized on read by the same store_kv and decode attention), the same rotary tables. A wq form marked for int8 activations takes them (linear_wq_a8) in
steps of at most group_quant.a8_rows rows (the installed wq_a8_max_tokens; every step for a form
with the int8-activation panels, which it then reads), the module forward's rule (layers/group_quant.py),
so both paths run the same kernel on the same rows. The
embedding lookup, the LM head and sampling stay in Python.

With --enable-lora the stack adds each adapted projection's LoRA delta too (csrc/cpu/
decode_lora.cpp, the compiled lora kernel), reading the LoRA pool's slot buffers in place and the
step's per-row slots (-1: the base model) that LoRAManager.prepare built for the module forward's
hooks: the same delta at the same point of the same chain.

It takes decode batches up to the size where the small-M linear kernels stop beating oneDNN
(layers/linear.py); for a weight-only quantized model whose every decoder linear runs its batches
on int8-activation panels (cpu_decode_batches.py), every decode batch, so a batched step too is one
call with no Python between its parallel regions; and speculative verify steps of chains with as
many rows in all (each row a decode row of its request: verify_rows_as_decode_rows); larger batches, extend batches, draft
trees, and models or devices it does not cover run the module forward. The module forward is the
reference it is tested against.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixserve.layers import cpu_fused
from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.layers.group_quant import a8_rows
from radixserve.layers.linear import INT8_FUSED_MAX_TOKENS, Linear
from radixserve.model_executor.cpu_decode_batches import fused_batch_bound
from radixserve.model_executor.cpu_decode_moe import (
    dense_mlp,
    empty_mlp_weights,
    moe_blocks,
    set_layer_moe,
    why_not_fused,
)
from radixserve.model_executor.cpu_panel_arena import gather_panels, step_order
from radixserve.model_executor.forward_batch import StepYielded
from radixserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from radixserve.distributed.model_parallel import ModelParallelism
    from radixserve.lora.manager import LoRAManager
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool
    from radixserve.model_executor.forward_batch import ForwardBatch, ModelWorkerBatch
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Whether this sgl-kernel build's linear_wq takes fp16 scales and offsets (the bindings say so;
# older builds: fp32 groups, read as they are).
KERNEL_TAKES_HALF_GROUPS = cpu_kernels is not None and cpu_kernels.linear_wq_half_groups()


def _weight(layer: Linear) -> torch.Tensor:
    """The form the small-M kernels read: the int8 weight or the fp16 copy when there is one, else
    the fp32 weight."""
    for weight in (layer.weight_int8, layer.weight_f16, layer.weight):
        if weight is not None:
            return weight.detach()
    raise AssertionError("a Linear always has its weight")


def _scale(layer: Linear | None) -> torch.Tensor | None:
    return None if layer is None else layer.weight_scale


def _wq(layer: Linear | None, narrow: bool) -> tuple | None:
    """A weight-only quantized form as DecodeModel.set_layer_wq takes it (linear_wq's arguments);
    with `narrow`, its scales and offsets as fp16 where that holds them exactly (half_groups).
    None for no form, or no linear (the empty MLP slot of a MoE layer without a shared expert)."""
    w = None if layer is None else layer.weight_wq
    if w is None:
        return None
    scales, offsets = half_groups(w.scales, w.offsets) if narrow else (w.scales, w.offsets)
    return (w.qweight, scales, offsets, w.bits, w.group_size)


def half_groups(
    scales: torch.Tensor, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp16 copies of a form's scales and offsets when fp16 holds every value exactly (GGUF's d
    and m are stored as fp16), else the fp32 tensors themselves. Why: at one token the step reads
    each weight once, and fp32 scales and offsets are a sixth of a Q4_1 weight's bytes, fp16 a
    twelfth: linear_wq widens fp16 ones exactly (the same bits), so half of those bytes are saved."""
    if not KERNEL_TAKES_HALF_GROUPS:
        return scales, offsets
    pair = [scales] if offsets is None else [scales, offsets]
    narrow = [t.half() for t in pair]
    if not all(torch.equal(h.float(), t) for h, t in zip(narrow, pair)):
        return scales, offsets
    return narrow[0], (narrow[1] if offsets is not None else None)


def _takes_a8(layer: Linear | None) -> bool:
    w = None if layer is None else layer.weight_wq
    return w is not None and w.int8_activations


def _panels(layer: Linear | None) -> tuple | None:
    """A marked form's 8-row panels as DecodeModel.set_layer_wq_a8_panels takes them, or None."""
    w = None if layer is None else layer.weight_wq
    p = None if w is None or not w.int8_activations else w.a8_packed
    return None if p is None else (p.q, p.scales, p.offsets, p.zero_point)


def _bias(layer: Linear | None) -> torch.Tensor | None:
    return None if layer is None or layer.bias is None else layer.bias.detach()


class CpuDecodeRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        token_to_kv_pool: MHATokenToKVPool,
        max_bs: int,
        tp_comm: object | None = None,  # sgl_kernel's ShmComm of the TP group (tp_size > 1)
        wq_a8_max_tokens: int = 0,  # the installed crossovers' (0: every wq form exact)
        wq_batch_a8_above: int = 0,  # batches above this run every wq form on its panels (0: none)
    ) -> None:
        inner = model.model
        first = inner.layers[0].self_attn
        self.embed_tokens = inner.embed_tokens
        self.max_bs = max_bs
        self.tp_comm = tp_comm
        self.decode_model = cpu_kernels.decode_model(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            inner.norm.variance_epsilon,
            first.attn.scaling,
            first.rotary_emb.cos_cached,
            first.rotary_emb.sin_cached,
        )
        # Whether the stack can stop between layers for a step that gives way (one rank only; an
        # sgl-kernel built before that: such steps run the module forward, which can).
        forward_doc = type(self.decode_model).forward.__doc__ or ""
        self.can_yield = tp_comm is None and "should_yield" in forward_doc
        # The panels the stack reads at one token, moved end to end in step order (cpu_panel_arena).
        self.panel_arena = gather_panels(step_order(inner.layers)) if wq_a8_max_tokens else None
        # The forms' int8-activation marks and panels go to the stack when either its small
        # products (wq_a8_max_tokens) or its batches (wq_batch_a8_above) read them: a start whose
        # tuning gave the batches panels but the one-row products none must still hand them over.
        a8_in_stack = bool(wq_a8_max_tokens or wq_batch_a8_above)
        for layer_id, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, dense_mlp(layer)  # mlp None: a MoE layer, no shared expert
            gate_up, down = (None, None) if mlp is None else (mlp.gate_up_proj, mlp.down_proj)
            empty_up, empty_down = empty_mlp_weights(inner.norm.weight.numel())
            k_buf, v_buf = token_to_kv_pool.get_kv_buffer(layer_id)
            self.decode_model.add_layer(
                layer.input_layernorm.weight.detach(),
                _weight(attn.qkv_proj),
                _bias(attn.qkv_proj),
                None if attn.q_norm is None else attn.q_norm.weight.detach(),
                None if attn.k_norm is None else attn.k_norm.weight.detach(),
                _weight(attn.o_proj),
                _bias(attn.o_proj),
                layer.post_attention_layernorm.weight.detach(),
                empty_up if gate_up is None else _weight(gate_up),
                _bias(gate_up),
                empty_down if down is None else _weight(down),
                _bias(down),
                k_buf,
                v_buf,
            )
            kv_scales = token_to_kv_pool.get_kv_scale_buffer(layer_id)  # int8 pools only
            if kv_scales is not None:
                self.decode_model.set_layer_kv_scales(layer_id, *kv_scales)
            linears = (attn.qkv_proj, attn.o_proj, gate_up, down)
            if any(lin is not None and lin.weight_int8 is not None for lin in linears):
                self.decode_model.set_layer_scales(layer_id, *(_scale(lin) for lin in linears))
            if any(lin is not None and lin.weight_wq is not None for lin in linears):
                # A form that may take int8 activations here without panels keeps fp32 groups
                # (linear_wq_a8 reads them); with panels its int8-activation products read those.
                narrow = [
                    not (wq_a8_max_tokens and _takes_a8(lin) and _panels(lin) is None) for lin in linears
                ]
                self.decode_model.set_layer_wq(layer_id, *(_wq(lin, n) for lin, n in zip(linears, narrow)))
                if a8_in_stack:
                    self.decode_model.set_layer_wq_a8(layer_id, *(_takes_a8(lin) for lin in linears))
                    if any(_panels(lin) is not None for lin in linears):
                        self.decode_model.set_layer_wq_a8_panels(layer_id, *(_panels(lin) for lin in linears))
            if layer.mlp is not mlp:  # a MoE layer: its block replaces the MLP (cpu_decode_moe.py)
                set_layer_moe(self.decode_model, layer_id, layer.mlp)
        if wq_a8_max_tokens:
            self.decode_model.set_wq_a8_max_tokens(wq_a8_max_tokens)
        if wq_batch_a8_above:
            self.decode_model.set_wq_batch_a8(wq_batch_a8_above)
        self.decode_model.set_final_norm(inner.norm.weight.detach())
        if tp_comm is not None:
            # Sharded weights: o_proj and down_proj partial sums are all-reduced inside the call.
            self.decode_model.set_tp_comm(tp_comm)
        self.lora: LoRAManager | None = None

    def attach_lora(self, lora: LoRAManager, num_layers: int) -> None:
        """Every layer's adapted parts, over the pool's own buffers (checked here: a RuntimeError
        says what the stack cannot take). The pool never reallocates, so this runs once."""
        num_slots = lora.config.max_loras_per_batch
        for layer_id in range(num_layers):
            parts = lora.fused_parts(layer_id)
            self.decode_model.set_layer_lora(
                layer_id,
                num_slots,
                parts["qkv_proj"],
                parts["o_proj"],
                parts["gate_up_proj"],
                parts["down_proj"],
            )
        self.lora = lora

    def can_run(self, batch: ModelWorkerBatch | ForwardBatch) -> bool:
        if batch.forward_mode.is_decode():
            return 0 < batch.batch_size <= self.max_bs
        # A verify step of chains whose rows all fit: see replay. Single rank only: at TP 2 it
        # once changed NGRAM's greedy tokens against one rank's in some test sessions; ranks then
        # drafted by their own clocks (fixed since: docs/speculative_decoding.md, issue 35), and
        # this path has not been re-checked at TP 2 after that fix.
        return (
            self.tp_comm is None
            and batch.forward_mode.is_target_verify()
            and getattr(batch, "spec_tree_parents", None) is None
            and 0 < int(batch.input_ids.shape[0]) <= self.max_bs
        )

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states [rows, hidden_size] of a decode batch, or of a verify batch of
        chains (KV written as a side effect)."""
        hidden = self.embed_tokens(fb.input_ids)  # [rows, hidden_size]
        pool_rows, seq_lens = fb.req_pool_indices, fb.seq_lens
        if fb.forward_mode.is_target_verify():
            pool_rows, seq_lens = verify_rows_as_decode_rows(fb)
        # The rows' adapter slots (LoRAManager.prepare ran for this batch); None: no adapted row.
        segments = None if self.lora is None else self.lora.segments
        out = self.decode_model.forward(
            hidden,
            fb.positions,
            fb.out_cache_loc,
            fb.req_to_token_pool.req_to_token,
            pool_rows,
            seq_lens,
            None if segments is None else segments.token_slots,
            fb.should_yield,  # asked before each layer (scheduler/idle_capacity.py)
        )
        if out is None:
            raise StepYielded("yielded inside the fused decode")
        return out


def verify_rows_as_decode_rows(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain verify step as decode rows: row j of request b (at position p_b + j, its KV in the
    slot req_to_token[b, p_b + j]) is a decode row of the same request with seq_len p_b + j + 1.
    The fused stack stores every row's K/V of a layer before that layer's attention, so row j
    attends the cached prefix and rows 0 .. j: the causal extend attention of a chain, exactly.
    Returns per-row req_pool_indices and seq_lens ([rows] int64)."""
    assert fb.extend_seq_lens_cpu is not None
    lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=fb.positions.device)
    pool_rows = torch.repeat_interleave(fb.req_pool_indices, lens)
    return pool_rows.contiguous(), (fb.positions + 1).contiguous()


def _fp32_model(model: torch.nn.Module) -> bool:
    """The stack computes in fp32: the embeddings (and so the hidden states) are fp32."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    return weight is not None and weight.dtype == torch.float32


def _reads_pool_dtype(dtype: torch.dtype) -> bool:
    """Whether this sgl-kernel build's DecodeModel reads and writes a KV pool of `dtype` in place:
    fp32 always; bf16 / fp8 / int8 in builds with set_layer_kv_scales (which also take every
    attention_kv_dtypes pool in add_layer)."""
    if dtype == torch.float32:
        return True
    decode_model_cls = getattr(getattr(cpu_kernels, "_ext", None), "DecodeModel", None)
    return hasattr(decode_model_cls, "set_layer_kv_scales") and dtype in cpu_kernels.attention_kv_dtypes()


def create_cpu_decode_runner(
    model: torch.nn.Module,
    token_to_kv_pool: MHATokenToKVPool,
    server_args: ServerArgs,
    parallel: ModelParallelism | None = None,
    lora: LoRAManager | None = None,
    max_decode_batch: int = 0,
) -> CpuDecodeRunner | None:
    """The fused decode path, or None where it does not apply (says why in the log at debug; at
    info where the user asked for something it cannot take: a quantized form, LoRA).
    `max_decode_batch`: the largest decode batch (the request pool's rows; 0: unknown, the small
    bound only), which a model whose batches run on panels takes whole (cpu_decode_batches.py)."""
    reasons = []
    tp_comm = None
    if parallel is not None and parallel.pp_size > 1:
        reasons.append("pipeline parallelism (a stage runs part of the stack)")
    if parallel is not None and parallel.tp.size > 1:
        fast = parallel.tp.fast
        tp_comm = getattr(fast, "handle", None)
        decode_model_cls = getattr(getattr(cpu_kernels, "_ext", None), "DecodeModel", None)
        if tp_comm is None or not hasattr(decode_model_cls, "set_tp_comm"):
            reasons.append("tensor parallelism without the shared-memory all-reduce")
    if server_args.device != "cpu" or not _fp32_model(model):
        reasons.append("not an fp32 CPU model")
    if server_args.attention_backend != "cpu":
        reasons.append(f"attention backend {server_args.attention_backend}")
    if not cpu_fused.ENABLED:
        reasons.append("sgl-kernel's CPU extension is not built")
    if not isinstance(model, LlamaForCausalLM):
        reasons.append(f"{type(model).__name__} is not Llama-family")
    elif (why := why_not_fused(moe_blocks(list(model.model.layers)), lora)) is not None:
        reasons.append(why)
    if server_args.disable_cpu_fused_decode:
        reasons.append("--disable-cpu-fused-decode")
    if reasons:
        logger.debug("CPU fused decode off: %s", "; ".join(reasons))
        return None
    # W8A8 int8 layers (w8a8_int8, or a compressed-tensors checkpoint).
    quantized = any(getattr(m, "weight_int8", None) is not None for m in model.modules())
    if quantized and not hasattr(getattr(cpu_kernels, "_ext", None), "linear_int8"):
        # An extension built before int8 weights: the module forward runs them (on the torch
        # reference). Said at info: the user asked for a fast format and should know it is not.
        logger.info("CPU fused decode off: this sgl-kernel build has no int8 linear (rebuild sgl-kernel)")
        return None
    wq_forms = [m.weight_wq for m in model.modules() if getattr(m, "weight_wq", None) is not None]
    has_wq = bool(wq_forms)
    decode_model_cls = getattr(getattr(cpu_kernels, "_ext", None), "DecodeModel", None)
    if has_wq and not hasattr(decode_model_cls, "set_layer_wq"):
        # The fused stack reads each linear's weight as one dense tensor; weight-only group
        # quantized layers run through the module forward (linear_wq per layer) instead.
        logger.info("CPU fused decode off: this sgl-kernel build cannot run weight-only quantized layers")
        return None
    # The module forward's bound per form (panels: every row count; else the installed
    # wq_a8_max_tokens), at most the fused steps' size (below).
    wq_a8_max_tokens = max(map(a8_rows, wq_forms), default=0)
    panels = any(w.a8_packed is not None for w in wq_forms)
    needed = "set_layer_wq_a8_panels" if panels else "set_layer_wq_a8"
    if wq_a8_max_tokens and not hasattr(decode_model_cls, needed):
        # The module forward runs int8 activations through linear_wq_a8 (on the panels if made);
        # this stack would not.
        logger.info(
            "CPU fused decode off: this sgl-kernel build has no int8 activations%s (rebuild sgl-kernel)",
            " on panels" if panels else "",
        )
        return None
    wq_batch_a8_above = 0
    if has_wq:
        # The layers run linear_wq up to wq_max_tokens on the module forward too (layers/linear.py),
        # and every batch where each runs its panels above that.
        max_bs = crossovers().wq_max_tokens
        if hasattr(decode_model_cls, "set_wq_batch_a8"):  # a build before it: the small bound
            layers = model.model.layers
            max_bs = fused_batch_bound(layers, max_decode_batch, tp_comm is None, lora is not None)
        if max_bs > crossovers().wq_max_tokens:
            wq_batch_a8_above = crossovers().wq_max_tokens
    elif quantized:
        max_bs = INT8_FUSED_MAX_TOKENS
    else:
        bound = crossovers()
        max_bs = bound.f16_max_tokens if server_args.cpu_fp16_weights else bound.f32_small_max_tokens
    if lora is not None and not hasattr(decode_model_cls, "set_layer_lora"):
        logger.info(
            "CPU fused decode off: this sgl-kernel build has no LoRA delta in it (rebuild sgl-kernel)"
        )
        return None
    if not _reads_pool_dtype(token_to_kv_pool.dtype):
        # A quantized KV pool (the default for quantized models) with a build whose stack reads fp32
        # pools only: the module forward runs every decode step.
        logger.info(
            "CPU fused decode off: this sgl-kernel build reads fp32 KV pools only, this pool is %s "
            "(rebuild sgl-kernel)",
            token_to_kv_pool.dtype,
        )
        return None
    wq_a8_max_tokens = min(wq_a8_max_tokens, max_bs)
    runner = CpuDecodeRunner(model, token_to_kv_pool, max_bs, tp_comm, wq_a8_max_tokens, wq_batch_a8_above)
    if lora is not None:
        try:
            runner.attach_lora(lora, len(model.model.layers))
        except RuntimeError as e:  # a form the compiled delta cannot take (a rank above its bound)
            logger.info("CPU fused decode off: the LoRA adapters' slots do not fit it: %s", e)
            return None
    with_lora = " (LoRA deltas included)" if lora is not None else ""
    with_a8 = f", int8 activations up to {wq_a8_max_tokens}" if wq_a8_max_tokens else ""
    if wq_batch_a8_above:
        with_a8 += f" and above {wq_batch_a8_above} (the batches' panels)"
    logger.info(
        "CPU fused decode: decode batches of <= %d requests run as one compiled call%s%s",
        max_bs,
        with_lora,
        with_a8,
    )
    return runner
