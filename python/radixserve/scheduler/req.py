"""A request's state inside the scheduler (seed 001 §7) and the reasons it can finish.

Lifecycle: WAITING -> EXTENDING (-> CHUNKED -> EXTENDING ...) -> DECODING -> FINISHED, with
DECODING -> WAITING on retraction/preemption and any state -> FINISHED on abort.
"""

from __future__ import annotations

import re
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.managers.io_struct import (
    NO_ROUTING,
    DisaggRouting,
    FinishAbort,
    FinishLength,
    FinishMatchedRegex,
    FinishMatchedStr,
    FinishMatchedToken,
    FinishReason,
    TokenizedGenerateReqInput,
)
from radixserve.multimodal.inputs import attach_mm_inputs
from radixserve.sampling.sampling_params import STOP_REGEX_TAIL_TOKENS, SamplingParams
from radixserve.scheduler.req_timeline import ReqTimeline

if TYPE_CHECKING:
    from radixserve.mem_cache.base_cache import BasePrefixCache
    from radixserve.multimodal.inputs import MultimodalInputs


def first_stop(text: str, stops: list[str], ends_after: int = 0) -> str | None:
    """The stop string whose occurrence ending past `ends_after` starts first in `text` (the
    longest on a tie), so the text cut there holds no other stop string."""
    best: tuple[int, int] | None = None
    found: str | None = None
    for stop in stops:
        pos = text.find(stop, max(ends_after - len(stop) + 1, 0)) if stop else -1
        if pos >= 0 and (best is None or (pos, -len(stop)) < best):
            best, found = (pos, -len(stop)), stop
    return found


@dataclass
class ReqTimes:
    received: float  # time.time() when the server got the request
    queued: float = 0.0  # time.monotonic() when it (last) entered the waiting queue
    first_scheduled: float | None = None  # monotonic; running_timeout counts from here
    queue_time: float | None = None  # seconds in the waiting queue before first scheduled
    first_token: float | None = None
    finished: float | None = None


@dataclass
class ReqLogprobs:
    """Accumulated logprobs, plus how many of each were already sent to the detokenizer."""

    output_val: list[float] = field(default_factory=list)
    output_idx: list[int] = field(default_factory=list)
    top_val: list[list[float]] = field(default_factory=list)
    top_idx: list[list[int]] = field(default_factory=list)
    input_val: list[float] = field(default_factory=list)
    input_idx: list[int] = field(default_factory=list)
    # Per prompt position in input_val, its top-k (only with top_logprobs_num > 0).
    input_top_val: list[list[float]] = field(default_factory=list)
    input_top_idx: list[list[int]] = field(default_factory=list)
    # token_ids_logprob: per output token / per prompt position in input_val, the requested ids' logprobs.
    output_tid_val: list[list[float]] = field(default_factory=list)
    input_tid_val: list[list[float]] = field(default_factory=list)
    sent_output: int = 0
    sent_input: int = 0


@dataclass
class ReqSpecCounts:
    """Speculative decoding, per request: the verify forwards it took part in, the tokens those
    produced, the drafts proposed for it and how many of them were accepted (and kept)."""

    verify_ct: int = 0
    verify_tokens: int = 0
    num_drafts: int = 0
    num_accepted_drafts: int = 0


class Req:
    """The input and output state of one request (field names per seed 001 §7.1)."""

    def __init__(
        self,
        msg: TokenizedGenerateReqInput,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,  # noqa: ANN401 - any HF-style tokenizer with decode()
    ) -> None:
        """The request `msg` as the scheduler runs it; the model's EOS ids, and the tokenizer that
        stop strings are matched with (None: no stop strings)."""
        self.rid = msg.rid
        # The LoRA adapter (None: the base model); also the radix cache namespace of its KV.
        self.lora_id = msg.lora_id
        # [prompt_len, hidden_size] fp32: the prompt as embeddings (its ids are placeholders).
        embeds = msg.input_embeds
        self.input_embeds = None if embeds is None else torch.tensor(embeds, dtype=torch.float32)
        self.cache_salt = msg.cache_salt  # only requests with the same salt share cached prefixes
        # A CustomLogitProcessor instance (set by the scheduler from the request's spec), or None.
        self.custom_logit_processor: Any = None
        self.session_id: str | None = None  # set when the request continues a session
        self.origin_input_text = msg.input_text
        self.origin_input_ids = list(msg.input_ids)
        # Its images: the prompt's image tokens are their pad values then (multimodal/inputs.py).
        self.multimodal_inputs: MultimodalInputs | None = None
        if msg.mm_inputs is not None:
            attach_mm_inputs(self, msg.mm_inputs)
        self.sampling_params = msg.sampling_params
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.token_ids_logprob = msg.token_ids_logprob  # ids scored at each logprob position (or None)
        # The final hidden states (scheduler/hidden_states.py): the prompt's rows as one entry,
        # then one row per generated token but the last.
        self.return_hidden_states = msg.return_hidden_states
        self.hidden_states: list[torch.Tensor] = []  # [prompt_len, hidden], then [hidden] each
        self.hidden_chunks: list[torch.Tensor] = []  # the prompt's rows of the chunks run so far
        self.stream = msg.stream
        self.priority = msg.priority if msg.priority is not None else 0  # larger = more important
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self._init_prefill_only()
        self._init_stops(msg.sampling_params)
        # Prefill/decode disaggregation: the peer's bootstrap address and the pairing room (a PD
        # side sets them when it admits the request).
        self.routing: DisaggRouting = NO_ROUTING
        self.times = ReqTimes(received=msg.received_time if msg.received_time else time.time())
        # --enable-trace: only a request with a trace context is timed.
        self.timeline = ReqTimeline() if msg.trace is not None else None
        self._init_progress()

    def _init_prefill_only(self) -> None:
        """Prefill-only requests (seed 000 §17) finish when their prompt is computed; a generation
        request keeps these defaults (RequestTable.build_embedding_req sets them)."""
        self.is_embedding = False
        self.token_type_ids: list[int] | None = None
        self.label_token_ids: list[int] | None = None
        # Mean/CLS pooling reads every prompt token's hidden state in one forward: no cached
        # prefix (its states are not kept) and no chunking.
        self.needs_all_tokens = False
        self.embedding: Any = None  # a numpy float32 vector once computed

    def _init_stops(self, params: SamplingParams) -> None:
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        stops = params.stop or []
        self.stop_strs: list[str] = [stops] if isinstance(stops, str) else list(stops)
        self.stop_str_max_len = max((len(s.encode()) for s in self.stop_strs), default=0)  # bytes
        regexes = params.stop_regex or []
        self.stop_regexes = [re.compile(p) for p in ([regexes] if isinstance(regexes, str) else regexes)]

    def _init_progress(self) -> None:
        """What the scheduler advances as the request runs: output, KV, finish, in-flight state."""
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []  # origin_input_ids + output_ids, cut to the chunk being run
        # KV bookkeeping
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty((0,), dtype=torch.int64)  # [prefix_len]
        self.last_node: Any = None  # RadixCache TreeNode locked for this request
        # HiCache: matched tokens past prefix_indices that are on the host tier only, and their
        # deepest node; the prefill adder loads them back when it admits the request.
        self.host_hit_length = 0
        self.last_host_node: Any = None
        self.extend_input_len = 0
        # Positions whose KV is written or being written by an already launched forward: the worker
        # runs forwards in launch order, so anything launched later may read them.
        self.kv_committed_len = 0
        self.already_computed = 0  # prompt tokens computed by earlier chunks (not cache hits)
        self.cached_tokens = 0
        # Finish state
        self.finished_reason: FinishReason | None = None
        self.to_finish: FinishReason | None = None  # applied by the next check_finished()
        # Chunking / retraction
        self.is_chunked = 0  # > 0: chunks still in flight whose results must not be streamed
        self.is_retracted = False
        # Overlap bookkeeping: batches launched but not yet processed that contain this request, and
        # the FutureMap slot that will hold its newest token (None once that token is known).
        self.num_inflight = 0
        self.pending_future: int | None = None
        # Constrained decoding: the request's own xgrammar matcher (None: unconstrained) and the
        # (kind, spec) key of its compiled grammar.
        self.grammar: Any = None
        self.grammar_key: tuple[str, str] | None = None
        # Speculative decoding: the drafter's per-request state (None: never drafted) and counts.
        self.spec: Any = None
        self.spec_counts = ReqSpecCounts()
        self.logprobs = ReqLogprobs()
        self.sent_output_len = 0  # output_ids already sent to the detokenizer

    # ------------------------------------------------------------------ state
    def finished(self) -> bool:
        return self.finished_reason is not None

    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def cache_namespace(self) -> Hashable:
        """Whose KV the prefix cache files this request's under: its LoRA adapter's (None: the base
        model's), within its cache_salt if it has one; an input_embeds prompt's placeholder ids
        describe nothing, so its own."""
        if self.input_embeds is not None:
            return ("input_embeds", self.rid)
        if self.cache_salt is not None:
            return ("cache_salt", self.cache_salt, self.lora_id)
        return self.lora_id

    def set_finish_with_abort(self, message: str, status_code: int | None = None) -> None:
        self.finished_reason = FinishAbort(message, status_code)

    def add_hidden_rows(self, rows: torch.Tensor, prompt: bool, last_chunk: bool) -> None:
        """One forward's final states of this request: a prompt chunk's rows (the prompt's entry is
        whole with its last chunk), or a decode step's row of the token it fed."""
        if prompt and not self.hidden_states:
            self.hidden_chunks.append(rows)
            if last_chunk:
                self.hidden_states.append(torch.cat(self.hidden_chunks))
                self.hidden_chunks = []
        elif last_chunk:
            # A decode step, or the re-prefill of a retracted request: its prompt's rows were
            # recorded before, so only the last row (the newest token's) is new.
            self.hidden_states.append(rows[-1])

    # ------------------------------------------------------------------ scheduling
    def init_next_round_input(self, tree_cache: BasePrefixCache | None = None) -> None:
        """Set fill_ids and match the longest cached prefix (seed 001 §8).

        Without a tree cache (a resumed chunk) the prefix set by cache_unfinished_req is kept.
        """
        self.fill_ids = self.origin_input_ids + self.output_ids
        input_len = len(self.fill_ids)
        # At least one token must be computed: its logits give the next token.
        max_prefix_len = 0 if self.needs_all_tokens else input_len - 1
        if self.return_logprob and self.logprob_start_len >= 0:
            # Prompt logprobs need the logits of every position from logprob_start_len.
            max_prefix_len = min(max_prefix_len, self.logprob_start_len)
        if self.return_hidden_states and not self.hidden_states:
            max_prefix_len = 0  # every prompt row is reported, so none may come from the cache
        self.host_hit_length = 0
        if tree_cache is not None:
            match = tree_cache.match_prefix(self.fill_ids[: max(max_prefix_len, 0)], self.cache_namespace)
            self.prefix_indices = match.device_indices
            self.last_node = match.last_node
            self.host_hit_length, self.last_host_node = match.host_hit_length, match.last_host_node
        self.extend_input_len = input_len - len(self.prefix_indices)

    def set_extend_input_len(self, extend_input_len: int) -> None:
        """Cut this round to `extend_input_len` new tokens (a chunk)."""
        self.extend_input_len = extend_input_len
        self.fill_ids = self.fill_ids[: len(self.prefix_indices) + extend_input_len]

    # ------------------------------------------------------------------ finishing
    def check_finished(self) -> None:
        """Finish on abort, length, stop token or stop string (seed 001 §7.2 order)."""
        if self.finished_reason is not None:
            return
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        params = self.sampling_params
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishLength(len(self.output_ids))
            return
        if not self.output_ids or len(self.output_ids) < params.min_new_tokens:
            return
        last = self.output_ids[-1]
        # ignore_eos only disables the model's EOS; stop_token_ids the user asked for still stop.
        if last in self.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishMatchedToken(last)
            return
        if self.stop_strs and self.tokenizer is not None:
            stop = self._completed_stop_str()
            if stop is not None:
                self.finished_reason = FinishMatchedStr(stop)
                return
        if self.stop_regexes and self.tokenizer is not None:
            pattern = self._completed_stop_regex()
            if pattern is not None:
                self.finished_reason = FinishMatchedRegex(pattern)

    def _completed_stop_regex(self) -> str | None:
        """The first stop_regex with a non-empty match in the newest STOP_REGEX_TAIL_TOKENS
        tokens' text that ends in the newest token's text (so one found before min_new_tokens
        does not count later)."""
        tail_ids = self.output_ids[-STOP_REGEX_TAIL_TOKENS:]
        tail = self.tokenizer.decode(tail_ids)
        found = [(p, [m.span() for m in p.finditer(tail) if m.end() > m.start()]) for p in self.stop_regexes]
        if not any(spans for _, spans in found):
            return None  # the common step: one decode, no second one for the newest token's start
        ends_after = len(self.tokenizer.decode(tail_ids[:-1]).rstrip("\ufffd"))
        for pattern, spans in found:
            if any(end > ends_after for _, end in spans):
                return pattern.pattern
        return None

    def _completed_stop_str(self) -> str | None:
        """The stop string the newest token completed (the scheduler alone decides this; the
        detokenizer only cuts the text where it says, docs/architecture.md "A request's way")."""
        # A stop string of B UTF-8 bytes spans at most B tokens (every token adds a byte), so the
        # newest B + 1 tokens hold every match it can complete, without re-decoding the output.
        tail_ids = self.output_ids[-(self.stop_str_max_len + 1) :]
        tail = self.tokenizer.decode(tail_ids)
        if not any(stop in tail for stop in self.stop_strs):
            return None
        # Only a match ending in the newest token's text counts: one completed earlier (before
        # min_new_tokens) may still lie in the window. A character the newest token completes is
        # U+FFFD before it, so that part counts as the newest token's text.
        before = self.tokenizer.decode(tail_ids[:-1]).rstrip("\ufffd")
        return first_stop(tail, self.stop_strs, ends_after=len(before))

    # ------------------------------------------------------------------ logprobs
    def append_output_logprob(
        self,
        token_id: int,
        logprob: float | None,
        top_val: list[float] | None,
        top_idx: list[int] | None,
        tid_val: list[float] | None = None,
    ) -> None:
        if not self.return_logprob:
            return
        lp = self.logprobs
        lp.output_val.append(float(logprob) if logprob is not None else 0.0)
        lp.output_idx.append(token_id)
        if self.top_logprobs_num > 0:
            lp.top_val.append(list(top_val or []))
            lp.top_idx.append(list(top_idx or []))
        if self.token_ids_logprob is not None:
            lp.output_tid_val.append(list(tid_val or []))

    def append_input_logprobs(
        self,
        values: list[float],
        start_pos: int,
        top_val: list[list[float]] | None = None,
        top_idx: list[list[int]] | None = None,
        tid_val: list[list[float]] | None = None,
    ) -> None:
        """Prompt logprobs for positions start_pos .. start_pos + len(values) - 1 (and, with
        top_logprobs_num, each position's top-k in top_val / top_idx), keeping only prompt
        positions not reported yet: a re-prefill after retraction or preemption recomputes
        positions whose logprobs went out already (even with no output token yet, when the chunks
        before an in-flight last chunk were processed), and covers output tokens past the prompt."""
        if not self.return_logprob or not values:
            return
        lp = self.logprobs
        expected = max(self.logprob_start_len, 0) + 1 + len(lp.input_val)  # next unreported position
        lo = max(start_pos, expected)
        hi = min(start_pos + len(values), len(self.origin_input_ids))
        if lo >= hi:
            return
        lp.input_val.extend(values[lo - start_pos : hi - start_pos])
        lp.input_idx.extend(self.origin_input_ids[lo:hi])
        if self.top_logprobs_num > 0:
            n = hi - lo
            vals = (top_val or [])[lo - start_pos : hi - start_pos]
            idxs = (top_idx or [])[lo - start_pos : hi - start_pos]
            lp.input_top_val.extend([list(v) for v in vals] + [[] for _ in range(n - len(vals))])
            lp.input_top_idx.extend([list(v) for v in idxs] + [[] for _ in range(n - len(idxs))])
        if self.token_ids_logprob is not None:
            tids = (tid_val or [])[lo - start_pos : hi - start_pos]
            lp.input_tid_val.extend([list(v) for v in tids] + [[] for _ in range(hi - lo - len(tids))])

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, input_len={len(self.origin_input_ids)}, "
            f"output_len={len(self.output_ids)}, finished={self.finished_reason})"
        )
