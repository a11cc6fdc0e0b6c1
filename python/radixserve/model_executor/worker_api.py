"""The contract between the scheduler and a model worker: what a worker is (`WorkerInfo`, fixed
when it is built) and what it does (`ModelWorker`). Every layer of a worker stack
(`worker_stack.py`) states the same contract, so the scheduler never asks which one it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch

if TYPE_CHECKING:
    from radixserve.configs.pooling import EmbeddingConfig
    from radixserve.layers.moe.expert_distribution import ExpertDistributionRecorder
    from radixserve.lora.manager import LoRAManager
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.model_executor.weight_sync import ModelWeights
    from radixserve.multimodal.embedding_cache import EmbeddingCache


@dataclass(frozen=True)
class KVPools:
    """A worker stack's request rows and KV slots, made by its model runner and shared by every
    layer of the stack (a draft model may keep its own K/V pool, never its own rows or slots): the
    scheduler allocates rows and slots in them, the worker writes K/V."""

    req_to_token_pool: Any  # ReqToTokenPool: [max_req_num, max_context_len] request rows
    token_to_kv_pool_allocator: Any  # hands out KV slots of the pool, page by page
    max_total_num_tokens: int
    max_req_num: int
    max_context_len: int
    token_to_kv_pool: Any = None  # the K/V buffers (PD transfers read them); None: a test worker's


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker is, for the scheduler and its add-ons. The defaults describe a single-rank
    generative test worker that holds no real weights."""

    vocab_size: int  # the LM head's rows: every sampled id is below it
    device: torch.device | str = "cpu"
    is_generation: bool = True
    # Encoders attend bidirectionally: a token's KV depends on later tokens, so none is shared.
    is_causal: bool = True
    embedding_config: EmbeddingConfig | None = None  # a generative model's is last-token pooling
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # The model's attention and KV heads over all TP ranks (this rank's pool holds its shard);
    # None for a test worker whose pool holds every head of a model it does not describe.
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    # Weight updates, reads and memory release / resume; None for a worker without real weights.
    weights: ModelWeights | None = None
    # LoRA adapters and their compute slots; None without --enable-lora.
    lora: LoRAManager | None = None
    takes_images: bool = False  # the model has a vision tower (requests may carry images)
    mm_cache: EmbeddingCache | None = None  # its encoder outputs by image hash (--mm-cache-size-mb)
    # The MoE routing counts; None without --expert-distribution-recorder-mode.
    expert_recorder: ExpertDistributionRecorder | None = None

    @property
    def embedding_needs_all_tokens(self) -> bool:
        """Pooling reads every prompt token's state (mean pooling), not only the last one's."""
        return self.embedding_config is not None and self.embedding_config.pooling.needs_all_tokens


class ModelWorker(Protocol):
    """What the scheduler (loops, builder, control plane, PD sides) uses of a worker stack."""

    info: WorkerInfo
    pools: KVPools

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult | None:
        """Forward and sample (on a pipeline stage before the last: forward and hand on, None).
        With mwb.delay_sample_launch only the forward runs: the result's delay_sample_func
        samples. A TARGET_VERIFY batch's result carries each request's accepted tokens."""
        ...

    def forward_batch_embedding(self, mwb: ModelWorkerBatch) -> EmbeddingBatchResult:
        """Forward a prefill-only batch: one vector per request, nothing sampled."""
        ...


class WorkerLayer:
    """A layer of a worker stack around TpModelWorker (`inner`): the same pools, info and
    embedding path; a subclass changes forward_batch_generation only."""

    def __init__(self, inner: TpModelWorker) -> None:
        self.inner = inner
        self.info = inner.info
        self.pools = inner.pools
        self.model_config = inner.model_config

    def forward_batch_embedding(self, mwb: ModelWorkerBatch) -> EmbeddingBatchResult:
        return self.inner.forward_batch_embedding(mwb)
