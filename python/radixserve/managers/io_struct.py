"""Every message that crosses a process boundary, plus the type-keyed dispatcher receivers use.

Flow (DESIGN.md): TokenizerManager --TokenizedGenerateReqInput / AbortReq / FlushCacheReqInput /
GetInternalStateReq--> Scheduler --BatchTokenIDOut--> Detokenizer --BatchStrOut--> TokenizerManager;
the scheduler answers control requests with their *Output message straight to the TokenizerManager.
Embedding requests (TokenizedEmbeddingReqInput, seed 000 §17) finish at prefill and never stream:
their vectors go straight back to the TokenizerManager in a BatchEmbeddingOut (nothing to detokenize).

All messages are frozen dataclasses with slots: cheap to build, safe to share between threads, and
picklable (ZMQ `send_pyobj`). Batch messages are columnar: `rids[i]` and every other list's `[i]`
describe the same request. Finish reasons are the typed `FinishReason` classes below from the
scheduler to the HTTP edge; only there do they become the native dict (`to_json`) or OpenAI's
finish_reason string.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from radixserve.managers.control_messages import *  # noqa: F403 - the control plane's messages
from radixserve.managers.control_messages import ControlOutcome, ControlReq, Ordering, SessionParams
from radixserve.managers.frozen_pickle import field_values, rebuild_frozen
from radixserve.sampling.sampling_params import SamplingParams

# Native finish_reason key: the output ended inside a multi-byte character (left out of the text).
PARTIAL_CHAR_DROPPED = "partial_char_dropped"
# The priority of OpenAI batch lines (/v1/batches): they run in idle capacity. Larger = more
# important; interactive requests carry 0 unless they say otherwise. This is below any priority a
# client sends in practice, and more than any --priority-scheduling-preemption-threshold below 0,
# so every interactive request may preempt a batch line (seed 000 §15). A request at or below it
# is batch-class: the overlap loop never launches a batch of only such requests ahead of the next
# one (scheduler/loops.py), so an interactive request never waits behind one it could not see.
BATCH_PRIORITY = -(2**31)


@dataclass(frozen=True)
class FinishReason(ABC):
    """Why a request ended. The detokenizer may set `partial_char_dropped` (docs/http_api.md)."""

    partial_char_dropped: bool = field(default=False, kw_only=True)

    @abstractmethod
    def _fields(self) -> dict[str, Any]: ...

    def to_json(self) -> dict[str, Any]:
        """The native API's finish_reason object: {"type": ..., ...}."""
        out = self._fields()
        if self.partial_char_dropped:
            out[PARTIAL_CHAR_DROPPED] = True
        return out


@dataclass(frozen=True)
class FinishLength(FinishReason):
    length: int

    def _fields(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FinishMatched(FinishReason):
    """A stop: the subclass says what matched (the native API reports each as type "stop")."""

    matched: int | str

    def _fields(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FinishMatchedToken(FinishMatched):
    """`matched` is the stop token id (an EOS id or one of stop_token_ids)."""


class FinishMatchedStr(FinishMatched):
    """`matched` is the stop string."""


class FinishMatchedRegex(FinishMatched):
    """A `stop_regex` pattern matched (SGLang's FINISHED_MATCHED_REGEX); `matched` is the pattern.
    The text keeps what matched: parts of it may have streamed before the match was complete."""


@dataclass(frozen=True)
class FinishAbort(FinishReason):
    message: str = "Aborted."
    status_code: int | None = None

    def _fields(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


# ---------------------------------------------------------------------------------------- requests
@dataclass(frozen=True, slots=True)
class DisaggRouting:
    """A request's prefill/decode disaggregation fields, copied as one value from the request
    item to the scheduler's Req: where the prefill server's bootstrap server is and the room (a
    number the load balancer draws) that pairs the request's two halves."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # The prefill replica holding the KV (decode side), or the one to serve it (prefill side).
    disagg_prefill_dp_rank: int | None = None


NO_ROUTING = DisaggRouting()  # a colocated request's: frozen, so one value serves every request


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The W3C trace context of a traced request (--enable-trace): the trace and the span the
    scheduler's spans belong under. The scheduler times a request only when it carries one."""

    # Lowercase hex, as in a `traceparent` header (msgspec cannot carry a 128-bit int).
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits: the request's span in the HTTP process


@dataclass(frozen=True, slots=True)
class ReqTrace:
    """What the scheduler timed of one traced request, sent once with its finish; the HTTP
    process turns it into spans. Times are time.time() seconds (one clock for every process of a
    node). `chunks`: (launch, result processed, prompt tokens computed) per prefill forward."""

    arrived: float  # the scheduler received it
    first_scheduled: float | None  # its first prefill was launched (None: never scheduled)
    chunks: tuple[tuple[float, float, int], ...]
    decode_start: float | None  # its first decode step was launched (None: never decoded)
    decode_end: float | None  # its last decode step's result was processed
    num_decode_steps: int
    sent: float  # the scheduler sent its final output


@dataclass(frozen=True, slots=True)
class TokenizedGenerateReqInput:
    """One generation request, tokenized and validated by the TokenizerManager."""

    rid: str
    input_text: str  # the prompt as text ("" when the client sent token ids); for logs only
    input_ids: list[int]
    sampling_params: SamplingParams  # already normalize()d and verify()d
    return_logprob: bool = False
    logprob_start_len: int = -1  # prompt position from which prompt logprobs are returned; -1: none
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int | None = None  # larger = more important (only with --enable-priority-scheduling)
    received_time: float = 0.0  # time.time() when the HTTP request arrived (for timeouts/metrics)
    session_params: SessionParams | None = None  # continue a session (scheduler/sessions.py)
    routed_dp_rank: int | None = None  # with --dp-size > 1: the replica the client asked for
    routing: DisaggRouting = NO_ROUTING
    lora_id: str | None = None  # the LoRA adapter to run with (None: the base model)
    return_hidden_states: bool = False  # (checked against --enable-return-hidden-states)
    # Prompt embeddings instead of tokens ([len(input_ids)] rows of hidden_size floats; the ids
    # are placeholders then).
    input_embeds: list[list[float]] | None = None
    # /health_generate's probe: on a busy scheduler it is answered by the next batch result
    # instead of queueing (scheduler/health_probes.py).
    health_check: bool = False
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes
    custom_logit_processor: str | None = None  # SGLang's to_str() form, checked by the TokenizerManager
    token_ids_logprob: tuple[int, ...] | None = None  # score these ids at each logprob position
    # Images (multimodal/processor.py): input_ids hold each image's expanded image tokens; the
    # scheduler replaces them with the image's pad value (multimodal/inputs.py).
    mm_inputs: MultimodalPayload | None = None
    trace: TraceContext | None = None  # --enable-trace: time it, for the spans of this trace


@dataclass(frozen=True, slots=True)
class ImageItemPayload:
    """One image of a request, processed by the model's image processor."""

    pixel_values: Any  # torch.Tensor [num_patches, channels * temporal_patch * patch * patch] fp32
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before the 2x2 merge)
    offset: int  # index of the image's first token in input_ids
    num_tokens: int  # image tokens the language model sees
    hash: int  # 64 bits of the pixels and the grid: the image's identity for the prefix cache


@dataclass(frozen=True, slots=True)
class MultimodalPayload:
    """A request's images and its M-RoPE positions (3-D: time, height, width) over the prompt."""

    items: tuple[ImageItemPayload, ...]
    mrope_positions: Any  # torch.Tensor [3, len(input_ids)] int64
    mrope_position_delta: int  # position of a token past the prompt = its index + this


@dataclass(frozen=True, slots=True)
class BatchTokenizedGenerateReqInput:
    """Several generation requests sent in one message (e.g. a batched /generate call or n > 1)."""

    reqs: list[TokenizedGenerateReqInput]


@dataclass(frozen=True, slots=True)
class TokenizedEmbeddingReqInput:
    """One request that finishes at prefill (seed 002 §5.2): an embedding, a classifier's logits,
    or (with `label_token_ids`) the next-token logprobs of a few tokens after the prompt (/v1/score,
    yes/no rerankers; these need a generation model's LM head)."""

    rid: str
    input_text: str  # for logs only
    input_ids: list[int]
    token_type_ids: list[int] | None = None  # segment ids of a (query, document) pair (BERT-style)
    label_token_ids: list[int] | None = None
    priority: int | None = None
    received_time: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchTokenizedEmbeddingReqInput:
    reqs: list[TokenizedEmbeddingReqInput]


@dataclass(frozen=True, slots=True)
class AbortReq(ControlReq, ordering=Ordering.BYPASS):
    """Abort the request `rid` and its n > 1 samples "rid-0", "rid-1", ... (see `rid_matches`), or
    every request when `abort_all`. It also aborts what a waiting barrier holds (control_plane.py)."""

    rid: str = ""
    abort_all: bool = False


def rid_matches(rid: str, target: str) -> bool:
    """Whether aborting `target` aborts `rid`: the rid itself or one of its samples "target-<i>".
    The seeds' plain prefix match also hit unrelated requests ("job" aborted "job-extra", "x-1"
    aborted "x-10"), so only a decimal sample index may follow the "-"."""
    if rid == target:
        return True
    return bool(target) and rid.startswith(f"{target}-") and rid[len(target) + 1 :].isdigit()


@dataclass(frozen=True, slots=True)
class FlushCacheReqInput(ControlReq, reply=ControlOutcome):
    """Drop the prefix cache and reset the KV pools; refused while requests are in flight."""


@dataclass(frozen=True, slots=True)
class GetInternalStateReqOutput:
    internal_state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class GetInternalStateReq(ControlReq, ordering=Ordering.BYPASS, reply=GetInternalStateReqOutput):
    """Ask the scheduler for a snapshot of its counters (for /get_server_info)."""


@dataclass(frozen=True, slots=True)
class GetLoadReqOutput:
    """One replica's load, as SGLang's /get_load lists it. Replicas also send it, unasked, to the
    DataParallelController whenever it changed (at most every --load-watch-interval s)."""

    dp_rank: int
    num_reqs: int  # running + waiting
    num_waiting_reqs: int
    num_tokens: int  # KV tokens held by requests + prompt tokens of waiting requests


@dataclass(frozen=True, slots=True)
class GetLoadReqInput(ControlReq, reply=GetLoadReqOutput):
    """Ask every replica for its load (/get_load)."""


# ---------------------------------------------------------------------------------------- outputs
class BlockReqType(Enum):
    BLOCK = 1
    UNBLOCK = 2


@dataclass(frozen=True, slots=True)
class BlockReqInput:
    """Hold (BLOCK) or release (UNBLOCK) every request the schedulers receive: the
    SchedulerInputBlocker (seed 002 §7.1) keeps them aside until every rank has unblocked."""

    type: BlockReqType


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutputs:
    """What the scheduler's step message and the detokenizer's carry alike, per request (`[i]` of
    every list is request `rids[i]`): what is new since the previous message for that rid."""

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    output_ids: list[list[int]]  # new output token ids per request
    prompt_tokens: list[int]
    completion_tokens: list[int]  # output tokens so far (all of them, not just the new ones)
    cached_tokens: list[int]  # prompt tokens served from the prefix cache
    # Per request: seconds it waited in the queue before its first prefill (None: never scheduled).
    queue_times: list[float | None] | None = None
    # Logprobs (None when no request in the message asked for them; [] for those that did not).
    output_token_logprobs_val: list[list[float]] | None = None  # logprob of each new output token
    output_token_logprobs_idx: list[list[int]] | None = None  # the token id it belongs to
    output_top_logprobs_val: list[list[list[float]]] | None = None  # per new token, top-k logprobs
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    input_token_logprobs_val: list[list[float]] | None = None  # prompt logprobs, new since last time
    input_token_logprobs_idx: list[list[int]] | None = None
    # Per new prompt position, its top-k logprobs ([] per position without top_logprobs_num).
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    # token_ids_logprob: per new output token / new prompt position, the logprob of each requested
    # id, in the request's order ([] for requests without the field; the ids are the request's).
    output_token_ids_logprobs_val: list[list[list[float]]] | None = None
    input_token_ids_logprobs_val: list[list[list[float]]] | None = None
    dp_rank: int = 0  # the data-parallel replica that sent it (metrics label)
    # return_hidden_states: per request its final hidden states (the prompt's rows, then one row
    # per generated token but the last), sent once with its finish; None when none asked.
    output_hidden_states: list[list[Any] | None] | None = None
    # Speculative decoding (None when it is off), per request since it started: verify forwards
    # it took part in, the tokens they produced, drafts proposed, drafts accepted.
    spec_verify_ct: list[int] | None = None
    spec_verify_tokens: list[int] | None = None
    spec_draft_token_num: list[int] | None = None
    spec_accept_token_num: list[int] | None = None
    # --enable-trace: per request its ReqTrace, sent once with its finish (None: nothing traced).
    traces: list[ReqTrace | None] | None = None

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[type, tuple[Any, ...]]]:
        """Pickled as (class, field values). A frozen slots dataclass's own pickling looks its
        fields up by name on both sides, once per decode step at one request, right after a
        forward when the caches are cold (docs/cpu_backend.md, "Host work around a step")."""
        cls = type(self)
        return rebuild_frozen, (cls, field_values(self))


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchTokenIDOut(StepOutputs):
    """Scheduler -> Detokenizer, one per scheduler step: every request that has something to report.

    A streaming request appears whenever it produced tokens; a non-streaming one only when it
    finishes (then `output_ids` holds its whole output). The detokenizer keeps per-rid decode state
    and drops it when `finished_reasons[i]` is set.
    """

    # Detokenization options, per request (the detokenizer is stateless about sampling params).
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]  # withheld from streams while they may begin; the scheduler matches


@dataclass(frozen=True, slots=True)
class EmbeddingBatchResult:
    """The outcome of one prefill-only forward (seed 001 §2.2): one float32 vector (a numpy array)
    per request of the batch (a chunk that is not its request's last one gets an empty one).
    Nothing is sampled."""

    embeddings: list[Any]  # [bs] numpy float32 arrays
    copy_done: Any | None = None  # kept for symmetry with GenerationBatchResult; None on CPU


@dataclass(frozen=True, slots=True)
class BatchEmbeddingOut:
    """Scheduler -> TokenizerManager: embedding requests that finished this step (or were refused)."""

    rids: list[str]
    finished_reasons: list[FinishReason]
    # numpy float32 vectors (pickled as raw bytes, not one Python float each); None when aborted
    embeddings: list[Any]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    queue_times: list[float | None] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchStrOut(StepOutputs):
    """Detokenizer -> TokenizerManager: `BatchTokenIDOut` with the new text of each request."""

    output_strs: list[str]  # text new since the previous message for that rid (of output_ids)


# ------------------------------------------------------------------------------------- dispatching
@dataclass(slots=True)
class TypeBasedDispatcher:
    """Route a message to its handler by type: one table per receiver (seed 002 §4.4).

    Handlers are tried in table order with isinstance, so list a subclass before its base. An
    unknown type raises ValueError: a message nobody handles is a bug, not something to drop.
    """

    mapping: list[tuple[type, Callable[[Any], Any]]] = field(default_factory=list)

    def __call__(self, obj: object) -> Any:  # noqa: ANN401 - handlers return their own types
        for ty, fn in self.mapping:
            if isinstance(obj, ty):
                return fn(obj)
        raise ValueError(f"Invalid object: {type(obj).__name__} has no handler")
