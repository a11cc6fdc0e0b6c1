"""Batch descriptions handed from the scheduler to the model.

ScheduleBatch (scheduler-owned) -> ModelWorkerBatch (plain CPU data the forward needs)
-> ForwardBatch (tensors on the model's device plus attention metadata, one step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

from radixserve.speculative.tree import flat_tree_mask, tree_positions
from radixserve.utils.host_tensors import int64_tensor

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionBackend
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.multimodal.inputs import MultimodalForward
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


class StepYielded(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A forward stopped between layers because its should_yield said so: nothing was sampled,
    and the KV it wrote for its new tokens is written again when the step runs again."""


@dataclass(frozen=True)
class InputEmbeds:
    """Rows of a forward whose input is an embedding given with the request (input_embeds) instead
    of its token's: the model's embedding output at `rows` ([k] int64) becomes `values` ([k,
    hidden_size])."""

    rows: torch.Tensor
    values: torch.Tensor

    def to(self, device: torch.device | str) -> InputEmbeds:
        return InputEmbeds(self.rows.to(device, non_blocking=True), self.values.to(device, non_blocking=True))

    def apply(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.index_copy(0, self.rows, self.values.to(hidden.dtype))


@dataclass(frozen=True)
class DeepstackEmbeds:
    """Qwen3-VL's deepstack: the states leaving decoder layer i (i < num_layers) get values[:, i]
    added at `rows` ([k] int64), the batch rows of image tokens; values [k, num_layers,
    hidden_size]."""

    rows: torch.Tensor
    values: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.values.shape[1]

    def add(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.index_add(0, self.rows, self.values[:, layer].to(hidden.dtype))


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill of new tokens, possibly on top of a cached prefix
    DECODE = 2  # exactly one new token per request
    MIXED = 3  # a chunked prefill and decodes in one forward
    IDLE = 4  # nothing to run (kept for data-parallel symmetry)
    PREBUILT = 5  # disaggregated decode: KV and first token came from a prefill server, no forward
    # Speculative decoding: each request's last accepted token plus its drafts, over its cached KV
    # (an extend whose logits are needed at every position).
    TARGET_VERIFY = 6
    # A draft model catching up on tokens the target accepted (same shape as an extend).
    DRAFT_EXTEND = 7

    def is_extend(self) -> bool:
        """Every mode whose requests add several tokens over a prefix: the extend attention path."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND,
        )

    def is_prefill(self) -> bool:
        """A batch of prompt tokens (possibly with decodes riding along): its requests join the
        running batch afterwards. Unlike is_extend(), not a verify or draft step."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ModelWorkerBatch:
    """What one forward needs, as CPU data. Built by ScheduleBatch.get_model_worker_batch()."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, prefix_len + extend_len
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    sampling_info: SamplingBatchInfo | None
    extend_seq_lens: list[int] | None = None  # [bs]; a decode request in MIXED has 1
    extend_prefix_lens: list[int] | None = None  # [bs]
    extend_num_tokens: int = 0
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    # [bs] token_ids_logprob per request (None for those without); None when no request has it.
    token_ids_logprobs: list[tuple[int, ...] | None] | None = None
    # Prompt logprobs are returned from this offset into each request's extend chunk (or None).
    extend_logprob_start_lens: list[int] | None = None
    # [bs] the prompt token right after each request's chunk (-1: the chunk ends the prompt): the
    # chunk's last position predicts it, so its logprob is reported with this chunk (or None).
    extend_logprob_next_token_ids: list[int] | None = None
    # Delayed sampling (seed 001 §2.2, overlap loop): run only the forward now; the result carries
    # delay_sample_func, called once the scheduler has set this batch's sampling state (grammar
    # mask, penalty counts), which depends on the previous batch's tokens.
    delay_sample_launch: bool = False
    # Prefill-only (embedding) batches: pooled outputs, no sampling (seed 000 §17).
    is_embedding: bool = False
    token_type_ids: torch.Tensor | None = None  # [num_tokens] int64 segment ids (BERT-style)
    # [bs] per request: score these next-token ids at the last position instead of pooling.
    label_token_ids: list[list[int] | None] | None = None
    # TARGET_VERIFY (and a draft model's tree pass) with a draft tree: per request the parent row
    # of each of its rows (-1 for the root; speculative/tree.py). None: every request is a chain
    # (plain causal extend).
    spec_tree_parents: list[list[int]] | None = None
    # [bs] each request's LoRA adapter (None: the base model); None when no request has one.
    lora_ids: tuple[str | None, ...] | None = None
    # [bs] whether each request asked for its final hidden states; None when none did.
    return_hidden_states: tuple[bool, ...] | None = None
    input_embeds: InputEmbeds | None = None  # extend rows given as embeddings (None: none)
    # A prefill's image rows (multimodal/inputs.py), and the M-RoPE positions [3, num_tokens] of a
    # batch with an image request in it (None: the 1-D positions on all three axes).
    multimodal: MultimodalForward | None = None
    mrope_positions: torch.Tensor | None = None
    # Asked before each decoder layer of the module forward; True stops the forward with
    # StepYielded (a step of idle-capacity requests giving way to input: scheduler/idle_capacity.py).
    should_yield: Callable[[], bool] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class GenerationBatchResult:
    """The outcome of one forward + sample, as the scheduler consumes it.

    With delay_sample_launch the forward returns it before sampling: next_token_ids and the other
    sampling outputs are set by `delay_sample_func()`, which the overlap executor calls in forward
    order (then clears), after the scheduler prepared the batch's sampling state.
    """

    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: torch.Tensor | None = None  # [bs] fp32
    top_logprobs_val: list[list[float]] | None = None
    top_logprobs_idx: list[list[int]] | None = None
    # Per request: logprobs of prompt tokens from extend_logprob_start_lens (None if not asked).
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    # token_ids_logprob, per request: per output token / per prompt position, the ids' logprobs.
    token_ids_logprobs_val: list[list[float]] | None = None
    input_token_ids_logprobs_val: list[list[list[float]]] | None = None
    # [bs] bool: rows the sampler could not draw a valid token for (see layers/sampler.py); their
    # requests are finished with an error and the placeholder token is never kept.
    invalid_rows: torch.Tensor | None = None
    copy_done: Any | None = None  # a CUDA event on GPU; None on CPU
    delay_sample_func: Callable[[], None] | None = None  # set only before a delayed sample ran
    # TARGET_VERIFY: per request, the tokens this round produced (accepted drafts + one from the
    # target), and how many of its drafts were accepted. None for every other mode.
    spec_output_ids: list[list[int]] | None = None
    spec_num_accepted: list[int] | None = None
    # Per request, the final hidden states of its rows in this forward ([rows, hidden] fp32 on the
    # CPU) if it asked for them (ModelWorkerBatch.return_hidden_states), else None.
    hidden_states: list[torch.Tensor | None] | None = None


@dataclass
class PPProxyTensors:
    """What a pipeline stage hands the next one: the hidden states and the residual stream after
    its last layer (the next stage's first layer adds them before its input norm)."""

    hidden: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]


@dataclass
class ForwardBatch:
    """Device tensors for one forward step, plus what attention backends need to find the KV."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: AttentionBackend
    extend_seq_lens_cpu: list[int] | None = None  # [bs]
    extend_num_tokens: int = 0
    sampling_info: SamplingBatchInfo | None = None
    return_logprob: bool = False
    # The sample reads each row's argmax only: every row greedy, no logprobs, penalties or grammar
    # mask, and the sampling state already prepared (not a delayed sample). The logits may then
    # hold -inf away from each row's possible maxima (layers/greedy_head.py).
    argmax_only: bool = False
    top_logprobs_nums: list[int] | None = None
    token_ids_logprobs: list[tuple[int, ...] | None] | None = None
    extend_logprob_start_lens: list[int] | None = None
    extend_logprob_next_token_ids: list[int] | None = None
    token_type_ids: torch.Tensor | None = None  # [num_tokens] int64
    input_embeds: InputEmbeds | None = None  # on the model's device
    deepstack_embeds: DeepstackEmbeds | None = None  # set by the model's forward (Qwen3-VL)
    multimodal: MultimodalForward | None = None  # the model's encoder reads it (ModelWorkerBatch)
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens] int64 on the model's device
    should_yield: Callable[[], bool] | None = None  # ModelWorkerBatch.should_yield
    # False for encoder models: every token attends to every token of its request.
    attn_causal: bool = True
    # A draft tree (ModelWorkerBatch.spec_tree_parents): per request its [e_b, e_b] ancestor mask
    # among the new rows (1 = attend), flattened and concatenated: [sum e_b^2] uint8. The cached
    # prefix stays fully visible. None: causal among the new rows.
    spec_tree_mask: torch.Tensor | None = None
    # Prefill-only forwards: the rows of the last layer's states the pooling reads ([bs] int64),
    # None for all. A model whose `returns_output_rows` is True then computes its last layer past
    # attention for those rows only and returns [len(output_rows), hidden_size].
    output_rows: torch.Tensor | None = None
    # EAGLE heads (speculative/eagle_draft.py): the target keeps the residual stream entering each
    # of these layers (the output of the layer before; EAGLE3's aux layers) in spec_hidden,
    # concatenated [num_tokens, len * hidden_size]; ModelRunner.forward(capture_hidden=True) with
    # no layers keeps the final normed states there instead (EAGLE).
    capture_aux_layers: tuple[int, ...] = ()
    spec_hidden: torch.Tensor | None = None
    attn_metadata: Any = field(default=None)

    @classmethod
    def init_new(
        cls,
        batch: ModelWorkerBatch,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        attn_backend: AttentionBackend,
        device: torch.device,
        init_attn_metadata: bool = True,  # False when a CUDA graph replays: its hook fills them
        attn_causal: bool = True,
    ) -> ForwardBatch:
        seq_lens_cpu = batch.seq_lens.tolist()
        tree_mask = None
        if batch.forward_mode.is_extend() and batch.spec_tree_parents is not None:
            assert batch.extend_prefix_lens is not None
            # A tree row sits at prefix + its depth, not prefix + its row.
            positions = tree_positions(batch.extend_prefix_lens, batch.spec_tree_parents)
            tree_mask = flat_tree_mask(batch.spec_tree_parents).to(device)
        elif batch.forward_mode.is_extend():
            assert batch.extend_seq_lens is not None and batch.extend_prefix_lens is not None
            positions = _extend_positions(batch.extend_prefix_lens, batch.extend_seq_lens)
        else:
            # The new token sits at seq_len - 1 (from the list: cheaper than a tensor op, see int64_tensor).
            positions = int64_tensor([n - 1 for n in seq_lens_cpu])
        fb = cls(
            **{name: _on_device(getattr(batch, name), device) for name in _FROM_BATCH},
            batch_size=len(seq_lens_cpu),
            positions=_on_device(positions, device),
            seq_lens_cpu=seq_lens_cpu,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            extend_seq_lens_cpu=batch.extend_seq_lens,
            argmax_only=is_argmax_only(batch),
            attn_causal=attn_causal,
            spec_tree_mask=tree_mask,
        )
        if init_attn_metadata:
            attn_backend.init_forward_metadata(fb)
        return fb


# What a ForwardBatch takes from its ModelWorkerBatch under the same name (a field added to both
# passes on without a third edit), its tensors moved to the model's device.
_FROM_BATCH = tuple({f.name for f in fields(ForwardBatch)} & {f.name for f in fields(ModelWorkerBatch)})


def _on_device(value: Any, device: torch.device) -> Any:  # noqa: ANN401 - any batch field
    if isinstance(value, torch.Tensor):
        # The device test costs half a no-op .to() (whose argument parsing runs every step).
        return value if value.device == device else value.to(device, non_blocking=True)
    return value.to(device) if isinstance(value, InputEmbeds) else value


def _extend_positions(prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    """Positions prefix_len .. prefix_len + extend_len - 1 of every request, concatenated."""
    lens = torch.tensor(extend_lens, dtype=torch.int64)  # [bs]
    starts = torch.tensor(prefix_lens, dtype=torch.int64)  # [bs]
    total = int(lens.sum())
    # offset of each token inside its request: arange(total) - (start of its request's run)
    run_starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # [num_tokens]
    return torch.repeat_interleave(starts, lens) + torch.arange(total, dtype=torch.int64) - run_starts


def is_argmax_only(batch: ModelWorkerBatch) -> bool:
    """ForwardBatch.argmax_only for `batch` (its comment says what it promises)."""
    info = batch.sampling_info
    return (
        info is not None
        and not batch.delay_sample_launch
        and not batch.return_logprob
        and info.is_all_greedy
        and info.penalizer is None
        and info.vocab_mask is None
        and info.custom is None
    )
