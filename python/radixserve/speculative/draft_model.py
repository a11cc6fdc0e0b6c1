"""STANDALONE with `--speculative-draft-model-path`: a separate, smaller model that shares the
target's tokenizer drafts the tokens a verify step checks. Runs in the model worker.

The draft has its own KV pool with the same slots as the target's: a token's slot index (the
request's req_to_token row, shared with the target) addresses its K/V in both pools, so the
allocator, the radix cache, retraction and freeing need to know nothing of the draft. Keeping the
draft's pool in step is the price:

- every forward the target runs without drafts (prefill chunks, mixed and plain decode batches)
  runs through the draft's layers on the same batch (`shadow`), which writes the draft's K/V of
  the same tokens into the same slots;
- a verify step drafts k tokens with k single-token decodes of the draft and one more decode of
  the last draft (`fill_chain_drafts(..., write_every_row=True)`): every row of the verify batch
  then has the draft's K/V, whichever of them the target accepts. Rejected rows' slots are freed
  by the target and later overwritten in both pools.

A radix-cache hit therefore finds the draft's K/V of the prefix where the target's is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.linear import prepare_cpu_linears
from radixserve.layers.vocab_parallel import make_lm_head
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.model_executor.forward_batch import ForwardBatch, ModelWorkerBatch
from radixserve.model_executor.model_runner import create_attention_backend
from radixserve.model_loader.loader import load_model
from radixserve.speculative.draft_tree import fill_tree_drafts
from radixserve.speculative.layer_skip_draft import fill_chain_drafts

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class DraftRuntime:
    """What every separate draft model has (DraftModel here, EAGLE heads in eagle_draft.py): its
    weights (CPU-prepared), its own KV pool over the target's slots, and its own attention backend
    (a backend keeps the metadata of the forward it was set up for)."""

    def __init__(
        self,
        target: ModelRunner,
        config: ModelConfig,
        server_args: ServerArgs,
        extra_linears: Callable[[torch.nn.Module], list[torch.nn.Module]] = lambda model: [],
    ) -> None:
        start = time.perf_counter()
        self.config = config
        self.model = load_model(config, server_args.load_format, target.device, parallel=ModelParallelism())
        self.extra = extra_linears(self.model)  # e.g. the LM head as a Linear: CPU-prepared too
        if target.device.type == "cpu" and config.dtype == torch.float32:
            prepare_cpu_linears(
                [self.model, *self.extra], fp16=False, prepack=not server_args.disable_cpu_weight_prepack
            )
        self.req_to_token_pool = target.req_to_token_pool
        self.kv_pool = MHATokenToKVPool(
            target.max_total_num_tokens,
            target.page_size,
            config.dtype,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            target.device,
        )
        self.attn_backend = create_attention_backend(
            server_args.attention_backend or "torch_native", target.device
        )
        self.device = target.device
        logger.info(
            "Draft model loaded in %.1f s (%s, %d layers; KV pool %.2f GiB, the target's %d slots)",
            time.perf_counter() - start,
            config.architecture,
            config.num_layers,
            target.max_total_num_tokens
            * MHATokenToKVPool.kv_bytes_per_token(
                config.num_layers, config.num_kv_heads, config.head_dim, config.dtype
            )
            / 2**30,
            target.max_total_num_tokens,
        )

    def forward_batch(self, batch: ModelWorkerBatch, req_to_token_pool: object | None = None) -> ForwardBatch:
        """The ForwardBatch of `batch` over the draft's pool (and the target's req_to_token table
        unless another view of it is given)."""
        return ForwardBatch.init_new(
            batch,
            req_to_token_pool or self.req_to_token_pool,  # type: ignore[arg-type]
            self.kv_pool,
            self.attn_backend,
            self.device,
        )


class DraftModel:
    def __init__(self, target: ModelRunner, config: ModelConfig, server_args: ServerArgs) -> None:
        target_config = target.model_config
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"The draft model's vocabulary ({config.vocab_size} tokens) differs from the target's "
                f"({target_config.vocab_size}): --speculative-draft-model-path needs a model with the "
                "target's tokenizer"
            )
        self.runtime = DraftRuntime(
            target,
            config,
            server_args,
            lambda model: [make_lm_head(model.lm_head_weight, config.vocab_size, ModelParallelism().tp)],
        )
        self.model = self.runtime.model
        self.lm_head = self.runtime.extra[0]
        self.kv_pool = self.runtime.kv_pool
        self.req_to_token_pool = self.runtime.req_to_token_pool  # the target's: slots are shared
        self.topk = server_args.speculative_eagle_topk or 1  # > 1: draft trees (draft_tree.py)
        self.num_steps = server_args.speculative_num_steps or 0

    @classmethod
    def from_server_args(cls, target: ModelRunner, server_args: ServerArgs) -> DraftModel:
        assert server_args.speculative_draft_model_path is not None
        config = ModelConfig.from_path(
            server_args.speculative_draft_model_path,
            server_args.context_length,
            server_args.dtype,
            server_args.device or "cpu",
        )
        return cls(target, config, server_args)

    def _forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        fb = self.runtime.forward_batch(batch)
        return self.model(fb.input_ids, fb.positions, fb)  # [num_tokens, hidden_size]

    @torch.inference_mode()
    def shadow(self, batch: ModelWorkerBatch) -> None:
        """Write the draft's K/V of a batch the target runs without drafts."""
        self._forward(batch)

    @torch.inference_mode()
    def fill_drafts(self, batch: ModelWorkerBatch) -> None:
        if self.topk > 1:
            fill_tree_drafts(batch, self._row_logits, self.topk, self.num_steps, write_every_row=True)
        else:
            fill_chain_drafts(batch, self._next_tokens, write_every_row=True)

    def _row_logits(self, batch: ModelWorkerBatch, rows: list[int]) -> torch.Tensor:
        hidden = self._forward(batch)
        if not rows:  # a pass that only writes the draft's K/V (and linear_f32 takes no empty input)
            return torch.empty(0)
        return self.lm_head(hidden[rows]).float().cpu()  # [len(rows), vocab]

    def _next_tokens(self, batch: ModelWorkerBatch) -> torch.Tensor:
        return self.lm_head(self._forward(batch)).float().argmax(dim=-1).cpu()  # [bs]
