"""Drive the model on a static batch without the scheduler: one prefill, then decode steps.

Used by bench_one_batch and by the engine-core tests (HF parity) so that the model path can be
checked on its own. Requests may reuse the KV of an earlier request's prefix by pointing their
ReqToTokenPool row at its slots, exactly as the radix cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.model_executor.forward_batch import ForwardMode, GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.stage_worker import PipelineStageWorker
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_api import WorkerLayer
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class StaticReq:
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    req_pool_idx: int = -1
    # Reuse the KV of positions [0, len(prefix_slots)) from these slots instead of recomputing them.
    prefix_slots: torch.Tensor | None = None
    # The KV slot of the last position written, kept on the host: reading it back from the
    # request table would synchronise with the device once per request and step.
    last_slot: int = -1
    # The LoRA adapter (its id in the worker's LoRAManager) the request runs with; None: the base model.
    lora_id: str | None = None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


class StaticBatchRunner:
    def __init__(self, worker: TpModelWorker | WorkerLayer, return_logprob: bool = False) -> None:
        self.worker = worker
        # Pipeline stages: every stage goes on with the last stage's tokens.
        self.stage_link = worker.stage_link if isinstance(worker, PipelineStageWorker) else None
        self.return_logprob = return_logprob
        self.req_to_token = worker.pools.req_to_token_pool.req_to_token  # [max_reqs, max_context_len]

    def slots_of(self, req: StaticReq, length: int) -> torch.Tensor:
        return self.req_to_token[req.req_pool_idx, :length].long().clone()

    def prefill(self, reqs: list[StaticReq]) -> GenerationBatchResult:
        rows = self.worker.pools.req_to_token_pool.alloc(len(reqs))
        if rows is None:
            raise RuntimeError("ReqToTokenPool exhausted")
        prefix_lens = [0 if r.prefix_slots is None else len(r.prefix_slots) for r in reqs]
        seq_lens = [len(r.origin_input_ids) for r in reqs]
        last_loc = [int(r.prefix_slots[-1]) if p else -1 for r, p in zip(reqs, prefix_lens)]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        out_cache_loc = self.worker.pools.token_to_kv_pool_allocator.alloc_extend(
            prefix_lens, seq_lens, last_loc, sum(extend_lens)
        )
        if out_cache_loc is None:
            raise RuntimeError("KV pool exhausted")
        offset = 0
        for req, row, p, s in zip(reqs, rows, prefix_lens, seq_lens):
            req.req_pool_idx = row
            if p:
                self.req_to_token[row, :p] = req.prefix_slots.to(torch.int32)
            self.req_to_token[row, p:s] = out_cache_loc[offset : offset + s - p].to(torch.int32)
            offset += s - p
            req.last_slot = int(out_cache_loc[offset - 1])
        input_ids = [t for r, p in zip(reqs, prefix_lens) for t in r.origin_input_ids[p:]]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc,
            sampling_info=self._sampling_info(reqs),
            extend_seq_lens=extend_lens,
            extend_prefix_lens=prefix_lens,
            extend_num_tokens=sum(extend_lens),
            return_logprob=self.return_logprob,
            lora_ids=_lora_ids(reqs),
        )
        return self._run(reqs, batch)

    def decode(self, reqs: list[StaticReq]) -> GenerationBatchResult:
        seq_lens = [r.seq_len for r in reqs]  # includes the token being fed now
        last_loc = [r.last_slot for r in reqs]
        out_cache_loc = self.worker.pools.token_to_kv_pool_allocator.alloc_decode(seq_lens, last_loc)
        if out_cache_loc is None:
            raise RuntimeError("KV pool exhausted")
        for req, slot in zip(reqs, out_cache_loc.tolist()):
            req.last_slot = slot
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
        # The batch stays on the host (the worker moves it), the table lives on the model's device.
        table = self.req_to_token
        table[rows.to(table.device), positions.to(table.device)] = out_cache_loc.to(table.device, torch.int32)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc,
            sampling_info=self._sampling_info(reqs),
            return_logprob=self.return_logprob,
            lora_ids=_lora_ids(reqs),
        )
        return self._run(reqs, batch)

    def release(self, reqs: list[StaticReq]) -> None:
        """Free each request's row and its own KV slots (not slots it borrowed as a prefix)."""
        allocator = self.worker.pools.token_to_kv_pool_allocator
        for req in reqs:
            start = 0 if req.prefix_slots is None else len(req.prefix_slots)
            kv_len = req.seq_len - 1  # the last sampled token was never fed
            allocator.free(self.req_to_token[req.req_pool_idx, start:kv_len].long())
            self.worker.pools.req_to_token_pool.free(req.req_pool_idx)

    def generate(self, reqs: list[StaticReq], max_new_tokens: int) -> None:
        self.prefill(reqs)
        for _ in range(max_new_tokens - 1):
            self.decode(reqs)

    def _sampling_info(self, reqs: list[StaticReq]) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_reqs(
            reqs, self.worker.info.vocab_size, self.worker.info.device, self.worker.model_config.eos_token_ids
        )

    def _run(self, reqs: list[StaticReq], batch: ModelWorkerBatch) -> GenerationBatchResult:
        result = self.worker.forward_batch_generation(batch)
        if self.stage_link is not None:
            result = self.stage_link.exchange_result(result)
        assert result is not None
        for i, (req, token) in enumerate(zip(reqs, result.next_token_ids.tolist())):
            req.output_ids.append(token)
            if result.next_token_logprobs is not None:
                req.output_logprobs.append(float(result.next_token_logprobs[i]))
        return result


def _lora_ids(reqs: list[StaticReq]) -> tuple[str | None, ...] | None:
    """The batch's adapters per request, or None when every request runs the base model."""
    ids = tuple(r.lora_id for r in reqs)
    return ids if any(ids) else None
