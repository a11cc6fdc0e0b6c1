"""ScheduleBatch: the scheduler-side batch (seed 001 §11.2), mostly CPU lists, turned into a
ModelWorkerBatch for each forward.

Per-step tensors are rebuilt from the requests by prepare_for_extend / prepare_for_decode: a step
builds Python lists and makes one torch.tensor per field, never a tensor op per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from radixserve.model_executor.forward_batch import ForwardMode, InputEmbeds, ModelWorkerBatch
from radixserve.multimodal.inputs import image_slices, mrope_batch_positions
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.req import Req
from radixserve.utils.host_tensors import int64_tensor as _i64

# Retraction assumes each kept request still decodes this many tokens before the next check
# (upstream SGLang's constant; the seeds give no formula for the new ratio).
RETRACT_DECODE_STEPS = 20


class ScheduleBatch:
    def __init__(
        self,
        reqs: list[Req],
        mem: KVMemory,
        vocab_size: int,
        device: str | torch.device = "cpu",
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.reqs = reqs
        self.mem = mem
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.forward_mode = ForwardMode.IDLE
        self.sampling_info: SamplingBatchInfo | None = None
        self.decoding_reqs: list[Req] = []  # the decode part of a MIXED batch
        # Per-step data, valid after prepare_for_extend / prepare_for_decode.
        self.input_ids = _i64([])  # [num_tokens]
        self.out_cache_loc = _i64([])  # [num_tokens]
        self.seq_lens: list[int] = []  # [bs]
        self.prefix_lens: list[int] = []  # [bs]
        self.extend_lens: list[int] = []  # [bs]
        self.extend_num_tokens = 0
        self.extend_logprob_start_lens: list[int] | None = None
        self.future_indices: list[int] | None = None  # overlap: FutureMap slot of each row's token
        self.spec_drafts: list[list[int]] | None = None  # TARGET_VERIFY: each request's drafts
        # TARGET_VERIFY with a draft tree: each request's row parents (speculative/tree.py).
        self.spec_tree_parents: list[list[int]] | None = None
        self.token_type_ids: torch.Tensor | None = None  # [num_tokens], extend only (BERT segments)
        self.input_embeds: InputEmbeds | None = None  # extend only: rows given as embeddings

    @classmethod
    def init_new(
        cls,
        reqs: list[Req],
        mem: KVMemory,
        vocab_size: int,
        device: str | torch.device = "cpu",
        eos_token_ids: tuple[int, ...] = (),
    ) -> ScheduleBatch:
        batch = cls(reqs, mem, vocab_size, device, eos_token_ids)
        batch.sampling_info = SamplingBatchInfo.from_reqs(reqs, vocab_size, device, eos_token_ids)
        return batch

    # ------------------------------------------------------------------ properties
    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def is_embedding(self) -> bool:
        """A prefill-only batch: pooled outputs instead of sampled tokens (batches never mix)."""
        return bool(self.reqs) and self.reqs[0].is_embedding

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    # ------------------------------------------------------------------ extend
    def prepare_for_extend(self) -> None:
        """Allocate rows and KV slots for each request's new tokens and fill req_to_token."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        new_row_reqs = [r for r in reqs if r.req_pool_idx is None]  # a resumed chunk keeps its row
        for r, row in zip(new_row_reqs, self.mem.alloc_rows(len(new_row_reqs))):
            r.req_pool_idx = row
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.seq_lens = [len(r.fill_ids) for r in reqs]
        self.extend_lens = [s - p for s, p in zip(self.seq_lens, self.prefix_lens)]
        self.extend_num_tokens = sum(self.extend_lens)
        self.input_ids = _i64(
            list(itertools.chain.from_iterable(r.fill_ids[p:] for r, p in zip(reqs, self.prefix_lens)))
        )
        last_loc = [int(r.prefix_indices[-1]) if p else -1 for r, p in zip(reqs, self.prefix_lens)]
        self.out_cache_loc = self.mem.alloc_extend(
            self.prefix_lens, self.seq_lens, last_loc, self.extend_num_tokens
        )
        self._write_req_to_token(reqs)
        self.token_type_ids = self._token_type_ids()
        self.input_embeds = self._input_embeds()
        for r, p, s in zip(reqs, self.prefix_lens, self.seq_lens):
            r.cached_tokens += max(p - r.already_computed, 0)
            r.already_computed = s
            r.kv_committed_len = s
            r.is_retracted = False
        self.extend_logprob_start_lens = self._logprob_start_lens() if self.return_logprob else None

    def _token_type_ids(self) -> torch.Tensor | None:
        """[num_tokens] segment ids of this step's tokens (0 where a request has none), or None."""
        if not any(r.token_type_ids for r in self.reqs):
            return None
        ids: list[int] = []
        for r, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens):
            ids.extend(r.token_type_ids[p:s] if r.token_type_ids else [0] * (s - p))
        return _i64(ids)

    def _input_embeds(self) -> InputEmbeds | None:
        """This step's prompt rows whose requests gave embeddings, at their rows in the batch."""
        rows, values, offset = [], [], 0
        for r, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens):
            if r.input_embeds is not None:
                end = min(s, r.input_embeds.shape[0])  # the outputs after the prompt are tokens
                if p < end:
                    rows.append(torch.arange(offset, offset + end - p))
                    values.append(r.input_embeds[p:end])
            offset += s - p
        return InputEmbeds(torch.cat(rows), torch.cat(values)) if rows else None

    def _write_req_to_token(self, reqs: list[Req]) -> None:
        """req_to_token[row, :seq_len] = prefix slots ++ new slots, as one scatter for the batch."""
        table = self.mem.req_to_token_pool.req_to_token
        seq = _i64(self.seq_lens)  # [bs]
        rows = torch.repeat_interleave(_i64([r.req_pool_idx for r in reqs]), seq)  # [sum seq]
        starts = torch.cumsum(seq, 0) - seq  # [bs]
        cols = torch.arange(int(seq.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, seq)
        pieces, offset = [], 0
        for r, ext in zip(reqs, self.extend_lens):
            pieces.append(r.prefix_indices.to(torch.int64))
            pieces.append(self.out_cache_loc[offset : offset + ext])
            offset += ext
        values = torch.cat(pieces) if pieces else _i64([])  # [sum seq]
        table[rows.to(table.device), cols.to(table.device)] = values.to(table.device, table.dtype)

    def _logprob_start_lens(self) -> list[int]:
        """Chunk-local offset from which each request wants prompt logprobs (extend_len: none)."""
        out = []
        for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens):
            if r.return_logprob and r.logprob_start_len >= 0:
                out.append(min(max(r.logprob_start_len - p, 0), e))
            else:
                out.append(e)
        return out

    def _logprob_next_token_ids(self) -> list[int]:
        """The prompt token right after each request's chunk (-1: none): the chunk's last position
        predicts it, so its prompt logprob is computed with this chunk, not the next one."""
        return [
            r.origin_input_ids[s] if r.return_logprob and s < len(r.origin_input_ids) else -1
            for r, s in zip(self.reqs, self.seq_lens)
        ]

    def _token_ids_logprobs(self) -> list[tuple[int, ...] | None] | None:
        """[bs] each request's token_ids_logprob (None without it); None when no request has it, so
        the forward skips the gather entirely."""
        if not self.return_logprob or all(r.token_ids_logprob is None for r in self.reqs):
            return None
        return [r.token_ids_logprob if r.return_logprob else None for r in self.reqs]

    # ------------------------------------------------------------------ decode
    def prepare_for_decode(self) -> None:
        """One new token per request: its input is the newest output token (a FutureMap reference
        while that token is still being computed) at position kv_committed_len."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        self.input_ids = _i64(
            [-r.pending_future if r.pending_future is not None else r.output_ids[-1] for r in reqs]
        )
        self.seq_lens = [r.kv_committed_len + 1 for r in reqs]
        self.prefix_lens = [s - 1 for s in self.seq_lens]
        self.extend_lens = [1] * len(reqs)
        self.extend_num_tokens = len(reqs)
        self.extend_logprob_start_lens = None
        self.token_type_ids = None
        self.input_embeds = None
        self._write_decode_slots([r.req_pool_idx for r in reqs])
        for r in reqs:
            r.kv_committed_len += 1

    def _write_decode_slots(self, rows: list[int]) -> None:
        """Allocate each request's slot for its new token and enter it in its row of the table. A
        table on the CPU is read and written through numpy: these few entries run right after the
        forward, where a small torch op costs several times a numpy one (mem_cache/allocator.py)."""
        pool, page_size = self.mem.req_to_token_pool, self.mem.page_size
        host = pool.host_table()
        if host is None:
            table = pool.req_to_token
            rows_t, pos_t = _i64(rows), _i64(self.prefix_lens)
            last_loc = table[rows_t, pos_t - 1].tolist() if rows and page_size > 1 else []
            self.out_cache_loc = self.mem.alloc_decode(self.seq_lens, last_loc)  # [bs]
            table[rows_t, pos_t] = self.out_cache_loc.to(table.device, table.dtype)
            return
        # Only a paged pool continues the page of the slot before (the allocator's last_loc).
        last_loc = host[rows, [p - 1 for p in self.prefix_lens]].tolist() if page_size > 1 else []
        self.out_cache_loc = self.mem.alloc_decode(self.seq_lens, last_loc)  # [bs]
        host[rows, self.prefix_lens] = self.out_cache_loc.numpy()

    def check_decode_mem(self) -> bool:
        return self.mem.can_decode([r.kv_committed_len + 1 for r in self.reqs])

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append an already prepared decode batch to this extend batch (seed 001 §9.3)."""
        self.forward_mode = ForwardMode.MIXED
        self.input_ids = torch.cat([self.input_ids, running.input_ids])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.prefix_lens = self.prefix_lens + running.prefix_lens
        self.seq_lens = self.seq_lens + running.seq_lens
        self.extend_lens = self.extend_lens + running.extend_lens
        self.extend_num_tokens += running.extend_num_tokens
        self.decoding_reqs = list(running.reqs)
        self.merge_batch(running)

    # ------------------------------------------------------------------ membership
    def filter_batch(
        self, keep_indices: list[int] | None = None, chunked_req_to_exclude: Sequence[Req] = ()
    ) -> None:
        """Keep `keep_indices`, or by default every request that is neither finished nor excluded."""
        if keep_indices is None:
            excluded = {id(r) for r in chunked_req_to_exclude}
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and id(r) not in excluded]
        if len(keep_indices) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        if self.sampling_info is not None:
            if keep_indices:
                self.sampling_info.filter(keep_indices)
            else:
                self.sampling_info = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        if other.sampling_info is not None:
            if self.sampling_info is None or not self.reqs:
                self.sampling_info = other.sampling_info
            else:
                self.sampling_info.merge(other.sampling_info)
        self.reqs = self.reqs + other.reqs

    def release_req(self, idx: int) -> Req:
        """Give back request idx's KV (keeping its output) so it can be re-queued."""
        req = self.reqs[idx]
        self.mem.release_retracted(req)
        req.is_retracted = True
        return req

    def retract_decode(self, priority_first: bool) -> tuple[list[Req], float, list[Req]]:
        """Retract requests until the rest can decode a step; returns (retracted, new_token_ratio,
        to_abort). Victims: lowest priority first, then longest output (seed 000 §10.2)."""
        order = sorted(
            range(len(self.reqs)), key=lambda i: self._retract_key(i, priority_first), reverse=True
        )
        retracted: list[Req] = []
        to_abort: list[Req] = []
        while order and not self.mem.can_decode([self.reqs[i].kv_committed_len + 1 for i in order]):
            idx = order.pop()
            if not order and self.mem.ceil_paged(self.reqs[idx].kv_committed_len + 1) > self.mem.total_tokens:
                # Alone and larger than the whole pool: it can never finish. (Admission caps every
                # request to the pool, so this needs a pool smaller than one sequence.)
                to_abort.append(self.release_req(idx))
                break
            # Alone but the pool is held elsewhere (a chunked prompt's computed chunks, or the KV
            # of requests that finished in a batch still in flight in the overlap loop): wait in
            # the queue until it is free again rather than fail a request that fits.
            retracted.append(self.release_req(idx))
        keep = sorted(order)
        self.filter_batch(keep_indices=keep)
        total_decoded = sum(len(r.output_ids) for r in self.reqs)
        total_max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        ratio = (total_decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / max(total_max_new, 1)
        return retracted, min(1.0, ratio), to_abort

    def _retract_key(self, i: int, priority_first: bool) -> tuple[int, int, int]:
        r = self.reqs[i]
        # Sorted descending and popped from the end: the last element is retracted first.
        return (r.priority if priority_first else 0, -len(r.output_ids), -len(r.origin_input_ids))

    # ------------------------------------------------------------------ forward
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        is_extend = self.forward_mode.is_extend()
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=_i64([r.req_pool_idx for r in self.reqs]),
            seq_lens=_i64(self.seq_lens),
            out_cache_loc=self.out_cache_loc,
            # The forward reads a shallow copy: filter/merge on the live batch rebind, never mutate.
            sampling_info=self.sampling_info.copy_for_forward() if self.sampling_info else None,
            extend_seq_lens=list(self.extend_lens) if is_extend else None,
            extend_prefix_lens=list(self.prefix_lens) if is_extend else None,
            extend_num_tokens=self.extend_num_tokens,
            return_logprob=self.return_logprob,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs] if self.return_logprob else None,
            token_ids_logprobs=self._token_ids_logprobs(),
            extend_logprob_start_lens=self.extend_logprob_start_lens if is_extend else None,
            extend_logprob_next_token_ids=(
                self._logprob_next_token_ids()
                if is_extend and self.extend_logprob_start_lens is not None
                else None
            ),
            is_embedding=self.is_embedding,
            token_type_ids=self.token_type_ids if is_extend else None,
            input_embeds=self.input_embeds if self.forward_mode.is_prefill() else None,
            multimodal=(
                image_slices(self.reqs, self.prefix_lens, self.seq_lens)
                if self.forward_mode.is_prefill()
                else None
            ),
            mrope_positions=mrope_batch_positions(self.reqs, self.prefix_lens, self.extend_lens),
            label_token_ids=[r.label_token_ids for r in self.reqs] if self.is_embedding else None,
            spec_tree_parents=self.spec_tree_parents if self.forward_mode.is_target_verify() else None,
            lora_ids=self._lora_ids(),
            return_hidden_states=self._hidden_flags(),
        )

    def _hidden_flags(self) -> tuple[bool, ...] | None:
        flags = tuple(r.return_hidden_states for r in self.reqs)
        return flags if any(flags) else None

    def _lora_ids(self) -> tuple[str | None, ...] | None:
        ids = tuple(r.lora_id for r in self.reqs)
        return ids if any(ids) else None

    def copy(self) -> ScheduleBatch:
        """What result processing needs, detached from later filter/merge of the live batch."""
        other = ScheduleBatch(list(self.reqs), self.mem, self.vocab_size, self.device, self.eos_token_ids)
        other.forward_mode = self.forward_mode
        other.sampling_info = self.sampling_info
        other.decoding_reqs = list(self.decoding_reqs)
        other.prefix_lens = list(self.prefix_lens)
        other.extend_lens = list(self.extend_lens)
        other.seq_lens = list(self.seq_lens)
        other.extend_logprob_start_lens = self.extend_logprob_start_lens
        other.future_indices = self.future_indices
        other.spec_drafts = self.spec_drafts
        other.spec_tree_parents = self.spec_tree_parents
        return other

    def __repr__(self) -> str:
        return f"ScheduleBatch(mode={self.forward_mode.name}, bs={len(self.reqs)})"
