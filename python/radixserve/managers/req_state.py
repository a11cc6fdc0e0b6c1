"""Per-request state kept by the TokenizerManager, and the output dicts built from it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.managers.generate_request import RequestItem
from radixserve.managers.io_struct import FinishReason, ReqTrace
from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class LogprobAccumulator:
    """Logprobs gathered across steps: (logprob, token_id) pairs and per-position top-k lists."""

    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)  # per input_token
    # token_ids_logprob: the requested ids' logprobs per output token / per input_token entry.
    output_tid: list[list[float]] = field(default_factory=list)
    input_tid: list[list[float] | None] = field(default_factory=list)


@dataclass
class ReqState:
    """One scheduler request (one sample of one prompt) as the TokenizerManager tracks it.

    `group_event` is shared by every item of one generate call, so a caller streaming a batch
    wakes up on any item's progress; `dirty` marks the items with unseen progress.
    """

    item: RequestItem
    input_ids: list[int]
    group_event: asyncio.Event
    created_time: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    finished: bool = False
    dirty: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time: float | None = None  # seconds in the scheduler's waiting queue (from the scheduler)
    last_token_time: float | None = None
    finished_time: float | None = None
    dp_rank: int | None = None  # the data-parallel replica serving it (known from its first output)
    logprobs: LogprobAccumulator = field(default_factory=LogprobAccumulator)
    # Speculative decoding (None when off): (verify forwards, tokens they produced, drafts
    # proposed, drafts accepted), as last reported by the scheduler.
    spec: tuple[int, int, int, int] | None = None
    embedding: list[float] | None = None  # prefill-only requests: the scheduler's vector
    hidden_states: list[Any] | None = None  # return_hidden_states: sent with the finish
    # --enable-trace: the request's span (utils/tracing.RequestSpan) and the scheduler's times.
    trace: Any = None
    sched_trace: ReqTrace | None = None

    @property
    def rid(self) -> str:
        return self.item.rid

    def finish(self, reason: FinishReason) -> None:
        self.finished = True
        self.finished_reason = reason
        self.finished_time = time.perf_counter()
        self.mark_dirty()

    def mark_dirty(self) -> None:
        self.dirty = True
        self.group_event.set()


def request_meta(state: ReqState) -> dict[str, Any]:
    """The meta_info fields every output (and the --log-requests finish line) carries; the
    latency runs to the finish, or to now while the request runs."""
    end = state.finished_time or time.perf_counter()  # set by finish(), exactly when finished
    return {
        "id": state.rid,
        "finish_reason": state.finished_reason.to_json() if state.finished_reason else None,
        "prompt_tokens": state.prompt_tokens or len(state.input_ids),
        "completion_tokens": state.completion_tokens or len(state.output_ids),
        "cached_tokens": state.cached_tokens,
        "e2e_latency": end - state.created_time,
    }


def build_output(state: ReqState, token_text: Callable[[int], str] | None) -> dict[str, Any]:
    """SGLang's output shape: text, output_ids, meta_info (and the item's index in the batch).

    `token_text` adds each logprob token's text (return_text_in_logprobs); None leaves it out.
    """
    meta = request_meta(state)
    if state.spec is not None:
        meta.update(spec_meta(*state.spec))
    if state.item.return_logprob:
        meta.update(_logprob_meta(state.logprobs, token_text))
        if state.item.token_ids_logprob is not None:
            meta.update(_token_ids_meta(state.logprobs, state.item.token_ids_logprob, token_text))
    if state.hidden_states is not None:
        meta["hidden_states"] = state.hidden_states
    return {
        "text": state.text,
        "output_ids": list(state.output_ids),
        "meta_info": meta,
        "index": state.item.index,
    }


def spec_meta(verify_ct: int, verify_tokens: int, num_drafts: int, num_accepted: int) -> dict[str, Any]:
    """SGLang's speculative-decoding meta_info fields. spec_accept_length: tokens per verify
    forward (accepted drafts + the target's own token), 0 before the first one."""
    return {
        "spec_verify_ct": verify_ct,
        "spec_accept_length": verify_tokens / verify_ct if verify_ct else 0.0,
        "spec_draft_token_num": num_drafts,
        "spec_accept_token_num": num_accepted,
        "spec_accept_rate": num_accepted / num_drafts if num_drafts else 0.0,
    }


def _logprob_meta(acc: LogprobAccumulator, token_text: Callable[[int], str] | None) -> dict[str, Any]:
    def triple(lp: float | None, tok: int) -> list[Any]:
        return [lp, tok, token_text(tok) if token_text else None]

    def top(entries: list[tuple[float, int]] | None) -> list[list[Any]] | None:
        return None if entries is None else [triple(lp, tok) for lp, tok in entries]

    return {
        "input_token_logprobs": [triple(lp, tok) for lp, tok in acc.input_token],
        "output_token_logprobs": [triple(lp, tok) for lp, tok in acc.output_token],
        "output_top_logprobs": [top(t) for t in acc.output_top],
        "input_top_logprobs": [top(t) for t in acc.input_top],
    }


def _token_ids_meta(
    acc: LogprobAccumulator, ids: tuple[int, ...], token_text: Callable[[int], str] | None
) -> dict[str, Any]:
    """SGLang's token_ids_logprob fields: per position, [logprob, token_id, text] of each requested
    id in the request's order (None for the prompt position at logprob_start_len, as top-k)."""

    def entries(vals: list[float] | None) -> list[list[Any]] | None:
        if vals is None:
            return None
        return [[lp, tok, token_text(tok) if token_text else None] for lp, tok in zip(vals, ids)]

    return {
        "input_token_ids_logprobs": [entries(v) for v in acc.input_tid],
        "output_token_ids_logprobs": [entries(v) for v in acc.output_tid],
    }


def embedding_item(index: int, rid: str, text: str | None, priority: int | None) -> RequestItem:
    """The RequestItem a prefill-only request is tracked by (nothing is sampled)."""
    return RequestItem(
        index=index,
        rid=rid,
        text=text,
        input_ids=None,
        sampling_params=SamplingParams(max_new_tokens=0),
        max_new_tokens_set=True,
        return_logprob=False,
        return_text_in_logprobs=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        priority=priority,
        prompt_index=index,
        sample_index=0,
    )


def build_embedding_output(state: ReqState) -> dict[str, Any]:
    """SGLang's /encode output: the vector and meta_info (no text, no output tokens)."""
    return {
        "embedding": state.embedding,
        "meta_info": {**request_meta(state), "completion_tokens": 0},
        "index": state.item.index,
    }
