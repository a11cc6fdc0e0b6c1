"""Result processing (seed 001 §5, seed 000 §11) and streaming: tokens are appended, finish
conditions checked, KV handed to the prefix cache, and each scheduler step sends ONE BatchTokenIDOut
with everything it has to report.

KV timing rule: a request that finishes releases its KV only once no launched batch containing it is
still unprocessed (in the overlap loop the next decode may already be running with it); that batch's
token is then dropped. An unfinished request's prompt is cached right after its prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import torch

from radixserve.managers.io_struct import BatchEmbeddingOut, BatchTokenIDOut, EmbeddingBatchResult, ReqTrace
from radixserve.model_executor.forward_batch import GenerationBatchResult
from radixserve.multimodal.inputs import maybe_clear_mm_inputs
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.req import FinishAbort, Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.speculative.verify_batch import release_rejected

logger = logging.getLogger(__name__)

INVALID_TOKEN_MESSAGE = (
    "The sampler found no valid next token for this request: its logits were not finite after "
    "penalties, grammar mask and temperature. The request was stopped; the server goes on."
)


class StepStats:
    """Counters the periodic log lines and get_internal_state read."""

    def __init__(self) -> None:
        self.num_generated_tokens = 0  # since the last decode log line
        self.last_log_time = time.monotonic()
        self.last_gen_throughput = 0.0
        self.cache_hit_tokens = 0
        self.cache_query_tokens = 0
        self.num_retracted_reqs = 0  # since start: decodes retracted because the KV pool was full
        # Speculative decoding, since start: verify rounds in which a request drafted, drafts
        # proposed and accepted in them.
        self.spec_num_rounds = 0
        self.spec_num_drafts = 0
        self.spec_num_accepted = 0

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_rounds += 1
        self.spec_num_drafts += num_drafts
        self.spec_num_accepted += num_accepted


class OutputProcessor:
    def __init__(
        self,
        mem: KVMemory,
        send_output: Callable[[object], None],
        on_finished: Callable[[Req], None],
        report_spec: bool = False,  # speculative decoding on: report its counters per request
        report_traces: bool = False,  # --enable-trace: send traced requests' times with their finish
    ) -> None:
        self.mem = mem
        self.report_spec = report_spec
        self.report_traces = report_traces
        self.send_output = send_output
        self.on_finished = on_finished
        self.stats = StepStats()
        self._step_reqs: dict[int, Req] = {}  # requests to report this step, in order

    # ------------------------------------------------------------------ results
    def process_batch_result(
        self, batch: ScheduleBatch, result: GenerationBatchResult | EmbeddingBatchResult
    ) -> None:
        if isinstance(result, EmbeddingBatchResult):
            self._process_embedding(batch, result)
            return
        next_token_ids, logprobs = self.sampled_tokens(result)
        if batch.forward_mode.is_decode():
            self._process_decode(batch, result, next_token_ids, logprobs)
        elif batch.forward_mode.is_target_verify():
            self._process_verify(batch, result, logprobs)
        else:
            self._process_prefill(batch, result, next_token_ids, logprobs)
            maybe_clear_mm_inputs(batch.reqs, batch.seq_lens)

    @staticmethod
    def sampled_tokens(result: GenerationBatchResult) -> tuple[list[int | None], list[float] | None]:
        """The batch's sampled ids and their logprobs on the host. A row the sampler could not
        draw for gets None: its request is failed, never fed the token."""
        if result.copy_done is not None:
            # Overlap on CUDA: the tokens are still being copied to the host (seed 001 §5.1).
            result.copy_done.synchronize()
        next_token_ids: list[int | None] = result.next_token_ids.tolist()  # [bs]
        logprobs = result.next_token_logprobs.tolist() if result.next_token_logprobs is not None else None
        # tolist and Python's any: one torch op, not .any() and bool() (two; see greedy_checked).
        invalid = result.invalid_rows.tolist() if result.invalid_rows is not None else None
        if invalid is not None and any(invalid):
            next_token_ids = [None if bad else t for t, bad in zip(next_token_ids, invalid)]
        return next_token_ids, logprobs

    def _begin(self, batch: ScheduleBatch, i: int, req: Req) -> bool:
        """Bookkeeping every row needs; True when this row's token must be dropped."""
        req.num_inflight -= 1
        if batch.future_indices is not None and req.pending_future == batch.future_indices[i]:
            req.pending_future = None
        if req.is_retracted:
            return True  # its KV is gone; it recomputes this token after re-admission
        if req.finished():  # finished while this batch was in flight
            self.release_if_idle(req)
            return True
        return False

    def _process_prefill(
        self,
        batch: ScheduleBatch,
        result: GenerationBatchResult,
        next_token_ids: list[int | None],
        logprobs: list[float] | None,
    ) -> None:
        decoding = {id(r) for r in batch.decoding_reqs}
        for i, req in enumerate(batch.reqs):
            if self._begin(batch, i, req):
                continue
            if id(req) not in decoding:
                self.record_input_logprobs(batch, result, i, req)
                record_hidden(result, i, req, prompt=True)
                if req.is_chunked > 0:  # a middle chunk: its sampled token means nothing
                    req.is_chunked -= 1
                    continue
            else:
                record_hidden(result, i, req, prompt=False)
            if req.sampling_params.max_new_tokens == 0:
                req.check_finished()  # a prompt-only request (echo / prompt logprobs): no token
            else:
                self._append_token(req, next_token_ids[i], result, logprobs, i)
            if req.finished():
                self.release_if_idle(req)
            elif id(req) not in decoding:
                self.mem.tree_cache.cache_unfinished_req(req)
            self.collect(req)

    def _process_embedding(self, batch: ScheduleBatch, result: EmbeddingBatchResult) -> None:
        """Prefill-only requests finish with their prompt's last chunk (seed 000 §17); their KV
        goes to the prefix cache like a finished generation's."""
        for i, req in enumerate(batch.reqs):
            if self._begin(batch, i, req):
                continue
            if req.is_chunked > 0:  # a middle chunk of a last-token-pooled prompt
                req.is_chunked -= 1
                continue
            req.embedding = result.embeddings[i]
            req.check_finished()  # an abort that arrived meanwhile wins; else length 0
            if req.times.first_token is None:
                req.times.first_token = time.monotonic()
            self.release_if_idle(req)
            self.collect(req)

    def _process_decode(
        self,
        batch: ScheduleBatch,
        result: GenerationBatchResult,
        next_token_ids: list[int | None],
        logprobs: list[float] | None,
    ) -> None:
        for i, req in enumerate(batch.reqs):
            if self._begin(batch, i, req):
                continue
            record_hidden(result, i, req, prompt=False)
            self._append_token(req, next_token_ids[i], result, logprobs, i)
            if req.finished():
                self.release_if_idle(req)
            self.collect(req)

    def _process_verify(
        self, batch: ScheduleBatch, result: GenerationBatchResult, logprobs: list[float] | None
    ) -> None:
        """Append each request's accepted tokens one at a time (a stop, length or abort ends the
        round early), then give back the KV of every position past the last accepted token."""
        assert result.spec_output_ids is not None and result.spec_num_accepted is not None
        assert batch.spec_drafts is not None
        for i, req in enumerate(batch.reqs):
            start, end = batch.prefix_lens[i], batch.seq_lens[i]  # positions computed this round
            req.num_inflight -= 1
            if req.is_retracted:
                continue  # its KV (drafts included) is gone already
            if req.finished():  # finished while in flight: keep only the already accepted token
                release_rejected(self.mem, req, start + 1, end)
                self.release_if_idle(req)
                continue
            num_drafts = len(batch.spec_drafts[i])
            record_hidden(result, i, req, prompt=False)  # asked only by requests that do not draft
            appended = 0
            for token_id in result.spec_output_ids[i]:
                # Logprobs are only asked by requests that do not draft: one token, row i.
                self._append_token(req, token_id, result, logprobs, i)
                appended += 1
                if req.finished():
                    break
            # The newest appended token has no KV yet; x0 and the accepted drafts before it do.
            release_rejected(self.mem, req, start + appended, end)
            counts = req.spec_counts
            counts.verify_ct += 1
            counts.verify_tokens += appended
            counts.num_drafts += num_drafts
            counts.num_accepted_drafts += min(result.spec_num_accepted[i], appended)
            if num_drafts:
                self.stats.record_verify(num_drafts, result.spec_num_accepted[i])
                req.spec.on_verified(num_drafts, result.spec_num_accepted[i])
            if req.finished():
                self.release_if_idle(req)
            self.collect(req)
        penalizer = batch.sampling_info.penalizer if batch.sampling_info is not None else None
        if penalizer is not None:
            # cumulate() below counts one token per row; the output length counts them all.
            extra = [len(t) - 1 for t in result.spec_output_ids]
            lens = penalizer.output_lens
            lens.add_(torch.tensor(extra, dtype=lens.dtype, device=lens.device))

    def _append_token(
        self,
        req: Req,
        token_id: int | None,
        result: GenerationBatchResult,
        logprobs: list[float] | None,
        i: int,
    ) -> None:
        if token_id is None:  # the sampler had no valid token for this row
            logger.error("Request %s stopped: no valid token (non-finite logits)", req.rid)
            req.set_finish_with_abort(INVALID_TOKEN_MESSAGE, int(HTTPStatus.INTERNAL_SERVER_ERROR))
            req.to_finish = None
            return
        req.output_ids.append(token_id)
        if req.spec is not None:
            req.spec.on_token(token_id)
        self.stats.num_generated_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = time.monotonic()
        if req.return_logprob:
            req.append_output_logprob(
                token_id,
                logprobs[i] if logprobs is not None else None,
                result.top_logprobs_val[i] if result.top_logprobs_val is not None else None,
                result.top_logprobs_idx[i] if result.top_logprobs_idx is not None else None,
                _row(result.token_ids_logprobs_val, i),
            )
        if req.grammar is not None:
            # Imported here: constrained/ imports the scheduler package (a cycle at module level).
            from radixserve.constrained.grammar_manager import accept_token

            accept_token(req, token_id)  # may set to_finish (grammar terminated), applied below
        req.check_finished()

    @staticmethod
    def record_input_logprobs(batch: ScheduleBatch, result: GenerationBatchResult, i: int, req: Req) -> None:
        if (
            not req.return_logprob
            or result.input_token_logprobs is None
            or batch.extend_logprob_start_lens is None
        ):
            return
        # The forward returns logprobs of chunk-local tokens start+1 .. extend_len-1.
        start = batch.prefix_lens[i] + batch.extend_logprob_start_lens[i] + 1
        top_val = result.input_top_logprobs_val[i] if result.input_top_logprobs_val is not None else None
        top_idx = result.input_top_logprobs_idx[i] if result.input_top_logprobs_idx is not None else None
        req.append_input_logprobs(
            result.input_token_logprobs[i],
            start,
            top_val,
            top_idx,
            _row(result.input_token_ids_logprobs_val, i),
        )

    # ------------------------------------------------------------------ finishing
    def release_if_idle(self, req: Req) -> None:
        """Release a finished request's KV unless a launched batch with it is still unprocessed."""
        if req.num_inflight == 0 and req.holds_kv():
            self.mem.release_finished(req)

    def finish_now(self, req: Req, message: str, status_code: int | None = None) -> None:
        """Abort a request outside result processing (waiting, chunked, rejected) and report it."""
        req.set_finish_with_abort(message, status_code)
        req.to_finish = None
        self.release_if_idle(req)
        self.collect(req)

    # ------------------------------------------------------------------ streaming
    def collect(self, req: Req) -> None:
        """Report req in this step's message: streaming requests always, others when finished."""
        if req.finished() or req.stream:
            self._step_reqs[id(req)] = req

    def flush(self) -> None:
        """Send this step's BatchTokenIDOut (nothing when no request has anything to report)."""
        if not self._step_reqs:
            return
        reqs = list(self._step_reqs.values())
        self._step_reqs.clear()
        generated = [r for r in reqs if not r.is_embedding]
        embedded = [r for r in reqs if r.is_embedding]
        if generated:
            self.send_output(self._build_message(generated, self.report_spec, self.report_traces))
        if embedded:
            self.send_output(self._build_embedding_message(embedded))
        for req in reqs:
            if req.finished():
                req.times.finished = time.monotonic()
                self.on_finished(req)

    @staticmethod
    def _build_embedding_message(reqs: list[Req]) -> BatchEmbeddingOut:
        aborted = [isinstance(r.finished_reason, FinishAbort) for r in reqs]
        return BatchEmbeddingOut(
            rids=[r.rid for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],  # collected once finished
            embeddings=[None if a else r.embedding for r, a in zip(reqs, aborted)],
            prompt_tokens=[len(r.origin_input_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            queue_times=[r.times.queue_time for r in reqs],
        )

    @staticmethod
    def _build_message(
        reqs: list[Req], report_spec: bool = False, report_traces: bool = False
    ) -> BatchTokenIDOut:
        output_ids, out_val, out_idx, top_val, top_idx, in_val, in_idx = [], [], [], [], [], [], []
        in_top_val, in_top_idx, out_tid, in_tid = [], [], [], []
        for req in reqs:
            output_ids.append(req.output_ids[req.sent_output_len :])
            req.sent_output_len = len(req.output_ids)
            lp = req.logprobs
            out_val.append(lp.output_val[lp.sent_output :])
            out_idx.append(lp.output_idx[lp.sent_output :])
            top_val.append(lp.top_val[lp.sent_output :])
            top_idx.append(lp.top_idx[lp.sent_output :])
            out_tid.append(lp.output_tid_val[lp.sent_output :])
            lp.sent_output = len(lp.output_val)
            in_val.append(lp.input_val[lp.sent_input :])
            in_idx.append(lp.input_idx[lp.sent_input :])
            in_top_val.append(lp.input_top_val[lp.sent_input :])
            in_top_idx.append(lp.input_top_idx[lp.sent_input :])
            in_tid.append(lp.input_tid_val[lp.sent_input :])
            lp.sent_input = len(lp.input_val)
        any_logprob = any(r.return_logprob for r in reqs)
        any_tid = any(r.return_logprob and r.token_ids_logprob is not None for r in reqs)
        return BatchTokenIDOut(
            rids=[r.rid for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            output_ids=output_ids,
            prompt_tokens=[len(r.origin_input_ids) for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
            spaces_between_special_tokens=[r.sampling_params.spaces_between_special_tokens for r in reqs],
            no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
            stop_strs=[list(r.stop_strs) for r in reqs],
            queue_times=[r.times.queue_time for r in reqs],
            output_token_logprobs_val=out_val if any_logprob else None,
            output_token_logprobs_idx=out_idx if any_logprob else None,
            output_top_logprobs_val=top_val if any_logprob else None,
            output_top_logprobs_idx=top_idx if any_logprob else None,
            input_token_logprobs_val=in_val if any_logprob else None,
            input_token_logprobs_idx=in_idx if any_logprob else None,
            input_top_logprobs_val=in_top_val if any_logprob else None,
            input_top_logprobs_idx=in_top_idx if any_logprob else None,
            output_token_ids_logprobs_val=out_tid if any_tid else None,
            input_token_ids_logprobs_val=in_tid if any_tid else None,
            output_hidden_states=_finished_hidden_states(reqs),
            traces=_finished_traces(reqs) if report_traces else None,
            spec_verify_ct=[r.spec_counts.verify_ct for r in reqs] if report_spec else None,
            spec_verify_tokens=[r.spec_counts.verify_tokens for r in reqs] if report_spec else None,
            spec_draft_token_num=[r.spec_counts.num_drafts for r in reqs] if report_spec else None,
            spec_accept_token_num=[r.spec_counts.num_accepted_drafts for r in reqs] if report_spec else None,
        )


def record_hidden(result: GenerationBatchResult, i: int, req: Req, prompt: bool) -> None:
    """Keep request i's final hidden states of this forward, if it asked for them."""
    rows = result.hidden_states[i] if result.hidden_states is not None else None
    if rows is not None:
        # Called before a middle chunk's countdown: is_chunked == 0 is the prompt's last chunk.
        req.add_hidden_rows(rows, prompt, last_chunk=req.is_chunked == 0)


def _finished_hidden_states(reqs: list[Req]) -> list[list[Any] | None] | None:
    """SGLang's meta_info hidden_states of each finished request that asked: the prompt's rows,
    then a row per generated token; sent once, as lists (the detokenizer imports no torch)."""
    done = [r.return_hidden_states and r.finished() for r in reqs]
    if not any(done):
        return None
    return [[h.tolist() for h in r.hidden_states] if d else None for r, d in zip(reqs, done)]


def _finished_traces(reqs: list[Req]) -> list[ReqTrace | None] | None:
    """--enable-trace: each finished traced request's times, sent once with its finish."""
    done = [r.timeline is not None and r.finished() for r in reqs]
    if not any(done):
        return None
    return [r.timeline.export() if d and r.timeline is not None else None for r, d in zip(reqs, done)]


def _row(rows: list[Any] | None, i: int) -> Any:  # noqa: ANN401 - one row of a per-request list
    """Row i of an optional per-request result list (None when the list is)."""
    return rows[i] if rows is not None else None
