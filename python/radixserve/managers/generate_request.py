"""The native generate request (POST /generate, Engine.generate) and its expansion into items.

A request is single or batched (`text: list[str]` / `input_ids: list[list[int]]`) and each prompt
may ask for `n` samples. `expand()` flattens it into one `RequestItem` per sample, in output
order (prompt-major), which is the unit the TokenizerManager tracks and the scheduler sees.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from radixserve.managers.control_messages import SessionParams
from radixserve.managers.io_struct import NO_ROUTING, DisaggRouting
from radixserve.managers.unsupported_fields import refuse_unsupported
from radixserve.sampling.sampling_params import SamplingParams, check_seed

# Per-request limits (docs/http_api.md, "Limits"): one call must not buy unbounded work.
MAX_N = 128  # samples per prompt; OpenAI's cap on `n`
MAX_TOP_LOGPROBS_NUM = 20  # alternatives per token; OpenAI's cap on `top_logprobs`
MAX_RID_LEN = 256  # characters of a request id (a uuid4 hex is 32)
MAX_TOKEN_IDS_LOGPROB = 128  # token ids scored per position (token_ids_logprob)


class GenerateReqInput(BaseModel):
    """SGLang's /generate body. Exactly one of `text` and `input_ids` is given.

    HTTP bodies are validated strictly (`model_validate_json(..., strict=True)`: "yes" is not a
    bool, "10" not an int); NaN and Infinity are refused in any float field."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # Instead of tokens: one embedding row ([hidden_size] floats) per prompt position, for one
    # prompt or a batch (SGLang's field). The model reads them in place of its token embeddings.
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    # Images (SGLang's field): data: URLs or base64 strings. One prompt: an image or a list of
    # them; a batch: one entry (an image, a list, or null) per prompt. The prompt holds one image
    # token per image (docs/multimodal.md).
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    # At every reported position, the logprobs of these token ids (SGLang's field; one list per
    # prompt for a batch, null for a prompt without). Needs return_logprob.
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    # The final (normed) hidden states: the prompt's rows, then one per generated token but the
    # last (SGLang's field; the server needs --enable-return-hidden-states).
    return_hidden_states: bool | list[bool] = False
    stream: bool = False
    priority: int | list[int] | None = None  # larger = sooner (with --enable-priority-scheduling)
    # Continue a session: {id, rid, offset, replace, drop_previous_output} (scheduler/sessions.py).
    session_params: dict[str, Any] | list[dict[str, Any]] | None = None
    # With --dp-size > 1: the replica that must serve every prompt of this call. SGLang's name, and
    # the alias the SGLang Model Gateway (--dp-aware) sends.
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    # The LoRA adapter by name (SGLang's field; one per prompt for a batch); None: the base model.
    lora_path: str | list[str | None] | None = None
    no_logs: bool = False  # keep this request out of --log-requests (SGLang's field, for ZDR)
    # Only requests with the same salt share cached prefixes (SGLang's and vLLM's field: tenants
    # cannot probe each other's prompts through cache-hit timing); one per prompt for a batch.
    cache_salt: str | list[str] | None = None
    # SGLang's CustomLogitProcessor.to_str() (one per prompt for a batch), with
    # --enable-custom-logit-processor; read, never unpickled (sampling/custom_logit_processor.py).
    custom_logit_processor: str | list[str | None] | None = None
    # Set by /health_generate only, never from a body: its probe (scheduler/health_probes.py).
    _health_check: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:  # noqa: ANN401 - the raw body
        refuse_unsupported(data)  # SGLang fields this server cannot honour: a 400, never dropped
        return data

    @property
    def dp_rank(self) -> int | None:
        """The replica asked for (routed_dp_rank or its alias data_parallel_rank), if any."""
        a, b = self.routed_dp_rank, self.data_parallel_rank
        if a is not None and b is not None and a != b:
            raise ValueError(f"routed_dp_rank ({a}) and data_parallel_rank ({b}) disagree.")
        return a if a is not None else b

    # Prefill/decode disaggregation (set by the load balancer; lists for a batch, one per prompt).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Decode side of a pair whose prefill server runs --dp-size > 1: the prefill replica holding
    # this request's KV (SGLang's name; the Gateway sends it with a DP-aware prefill worker).
    disagg_prefill_dp_rank: int | None = None

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        if self.input_embeds is not None:  # rows of floats, or prompts of rows
            return not (
                self.input_embeds and self.input_embeds[0] and isinstance(self.input_embeds[0][0], list)
            )
        return not (self.input_ids and isinstance(self.input_ids[0], list))

    @property
    def num_prompts(self) -> int:
        if self.is_single:
            return 1
        given = next(x for x in (self.text, self.input_ids, self.input_embeds) if x is not None)
        return len(given)

    def validate_shape(self) -> None:
        if self.input_embeds is not None:
            if self.text is not None or self.input_ids is not None:
                raise ValueError("Give one of 'text', 'input_ids' and 'input_embeds', not several.")
        elif (self.text is None) == (self.input_ids is None):
            raise ValueError("Exactly one of 'text' and 'input_ids' must be given.")
        if (
            self.input_ids is not None
            and not self.is_single
            and not all(isinstance(x, list) for x in self.input_ids)
        ):
            raise ValueError("'input_ids' must be a list of integers or a list of lists of integers.")
        if self.num_prompts == 0:
            raise ValueError("The batch of prompts is empty.")
        for name in (
            "sampling_params",
            "rid",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_hidden_states",
            "priority",
            "session_params",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "lora_path",
            "cache_salt",
            "custom_logit_processor",
        ):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.num_prompts:
                raise ValueError(f"'{name}' has {len(value)} entries for {self.num_prompts} prompts.")
            if isinstance(value, list) and self.is_single:
                raise ValueError(f"'{name}' must not be a list for a single prompt.")
        if isinstance(self.rid, str) and not self.is_single:
            raise ValueError("'rid' must be a list with one id per prompt for a batch.")
        for rid in self.rid if isinstance(self.rid, list) else [self.rid]:
            if rid is not None and len(rid) > MAX_RID_LEN:
                raise ValueError(f"A request id is at most {MAX_RID_LEN} characters, got {len(rid)}.")

    def _prompt(self, value: Any, i: int) -> Any:
        if value is None or self.is_single:
            return value
        return value[i]

    def images_of(self, i: int) -> tuple[str, ...] | None:
        """Prompt i's images (None: none); ValueError (400) on a shape that fits no prompt."""
        value = self.image_data
        if value is None:
            return None
        if not self.is_single:
            if not isinstance(value, list) or len(value) != self.num_prompts:
                raise ValueError("'image_data' of a batch needs one entry (or null) per prompt.")
            value = value[i]
        if value is None:
            return None
        images = (value,) if isinstance(value, str) else tuple(value)
        if not images or not all(isinstance(x, str) for x in images):
            raise ValueError("'image_data' of a prompt must be an image string or a list of them.")
        return images

    def expand(self) -> list[RequestItem]:
        """One item per (prompt, sample), prompt-major; raises ValueError on bad input."""
        self.validate_shape()
        routed = self.dp_rank
        if routed is not None and routed < 0:
            raise ValueError(f"routed_dp_rank must be >= 0, got {routed}.")
        if self.disagg_prefill_dp_rank is not None and self.disagg_prefill_dp_rank < 0:
            raise ValueError(f"disagg_prefill_dp_rank must be >= 0, got {self.disagg_prefill_dp_rank}.")
        items: list[RequestItem] = []
        for i in range(self.num_prompts):
            raw = dict(_pick(self.sampling_params, i) or {})
            params = SamplingParams.from_dict(raw)
            base_rid = _pick(self.rid, i) or uuid.uuid4().hex
            n = params.n
            if not 1 <= n <= MAX_N:  # n < 1: no item would ever be verified (an empty answer)
                raise ValueError(f"n must be in [1, {MAX_N}], got {n}.")
            if params.seed is not None:
                check_seed(params.seed, n)  # here, while the samples' seed + j are still one seed
            top_logprobs_num = int(_pick(self.top_logprobs_num, i))
            if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS_NUM:
                raise ValueError(
                    f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {top_logprobs_num}."
                )
            room = _pick(self.bootstrap_room, i)
            if room is not None and not 0 <= room < 2**63:
                raise ValueError(f"bootstrap_room must be in [0, 2**63), got {room}.")
            logprob_start_len = int(_pick(self.logprob_start_len, i))
            if logprob_start_len < -1:  # its upper bound, the prompt length, is checked once tokenized
                raise ValueError(f"logprob_start_len must be -1 or at least 0, got {logprob_start_len}.")
            session = parse_session_params(_pick(self.session_params, i))
            token_ids = token_ids_logprob_of(self, i)
            for j in range(n):
                items.append(
                    RequestItem(
                        index=len(items),
                        rid=base_rid if n == 1 else f"{base_rid}-{j}",
                        text=self._prompt(self.text, i),
                        input_ids=self._prompt(self.input_ids, i),
                        input_embeds=self._prompt(self.input_embeds, i),
                        image_data=self.images_of(i),
                        sampling_params=_sample_params(params, j),
                        max_new_tokens_set=raw.get("max_new_tokens") is not None,
                        return_logprob=bool(_pick(self.return_logprob, i)),
                        return_text_in_logprobs=self.return_text_in_logprobs,
                        return_hidden_states=bool(_pick(self.return_hidden_states, i)),
                        logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num,
                        priority=_pick(self.priority, i),
                        session_params=session,
                        routed_dp_rank=routed,
                        prompt_index=i,
                        sample_index=j,
                        lora_path=_pick(self.lora_path, i),
                        no_logs=self.no_logs,
                        cache_salt=_pick(self.cache_salt, i),
                        custom_logit_processor=_pick(self.custom_logit_processor, i),
                        health_check=self._health_check,
                        token_ids_logprob=token_ids,
                        routing=DisaggRouting(
                            _pick(self.bootstrap_host, i),
                            _pick(self.bootstrap_port, i),
                            # Each sample is its own transfer: both servers derive the same rooms.
                            None if room is None else (room + j) % 2**63,
                            self.disagg_prefill_dp_rank,
                        ),
                    )
                )
        seen: set[str] = set()
        for item in items:
            if item.rid in seen:
                raise ValueError(f"Duplicate request id {item.rid!r} in one request.")
            seen.add(item.rid)
        return items


_SESSION_FIELDS = {
    "id": str,
    "rid": str,
    "offset": int,
    "replace": bool,
    "drop_previous_output": bool,
}


def parse_session_params(raw: dict[str, Any] | None) -> SessionParams | None:
    """SGLang's session_params dict as a SessionParams; ValueError (400) on unknown or mistyped keys."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("'session_params' must be an object.")
    unknown = sorted(set(raw) - set(_SESSION_FIELDS))
    if unknown:
        raise ValueError(f"Unknown session_params field(s) {unknown}; known: {sorted(_SESSION_FIELDS)}.")
    for key, value in raw.items():
        want = _SESSION_FIELDS[key]
        if value is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
            raise ValueError(f"session_params.{key} must be a {want.__name__} or null, got {value!r}.")
    if raw.get("offset") is not None and raw["offset"] < 0:
        raise ValueError(f"session_params.offset must be >= 0, got {raw['offset']}.")
    return SessionParams(**raw)


def token_ids_logprob_of(obj: GenerateReqInput, i: int) -> tuple[int, ...] | None:
    """Prompt i's token_ids_logprob (None: not asked); ValueError (400) on a bad shape, a count over
    MAX_TOKEN_IDS_LOGPROB, or without return_logprob. SGLang drops the field silently then; here
    that would be a silent drop (issue 42), so it is refused instead."""
    value = obj.token_ids_logprob
    if value is None:
        return None
    nested = bool(value) and all(x is None or isinstance(x, list) for x in value)
    if obj.is_single == nested or (nested and len(value) != obj.num_prompts):
        raise ValueError(
            "'token_ids_logprob' must be a list of token ids for one prompt, or one such list "
            "(or null) per prompt."
        )
    if nested and value[i] is None:
        return None
    ids = tuple(value[i] if nested else value)
    if not 1 <= len(ids) <= MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(
            f"token_ids_logprob must hold 1 to {MAX_TOKEN_IDS_LOGPROB} token ids, got {len(ids)}."
        )
    if not _pick(obj.return_logprob, i):
        raise ValueError("token_ids_logprob needs return_logprob=true.")
    return ids


def _pick(value: Any, i: int) -> Any:
    """The i-th entry of a per-prompt list, or the scalar shared by all prompts."""
    return value[i] if isinstance(value, list) else value


def _sample_params(params: SamplingParams, sample_index: int) -> SamplingParams:
    """A private copy per sample; seeded samples get distinct yet reproducible seeds."""
    out = copy.deepcopy(params)
    if out.seed is not None:
        out.seed += sample_index
    return out


@dataclass(frozen=True)
class RequestItem:
    """One sample of one prompt: what becomes a single scheduler request."""

    index: int  # position in the response list
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams  # mutable: the TokenizerManager normalizes it once
    max_new_tokens_set: bool  # False: the default budget may shrink to fit the context
    return_logprob: bool
    return_text_in_logprobs: bool  # fill each logprob entry's token text (else None)
    logprob_start_len: int
    top_logprobs_num: int
    priority: int | None
    prompt_index: int
    sample_index: int
    session_params: SessionParams | None = None
    routed_dp_rank: int | None = None
    routing: DisaggRouting = NO_ROUTING
    lora_path: str | None = None  # the adapter's name, as the request gave it
    lora_id: str | None = None  # its current load's id (the TokenizerManager's LoRARegistry)
    return_hidden_states: bool = False
    input_embeds: list[list[float]] | None = None  # instead of text / input_ids
    # The prompt's images: data: URLs, base64, URLs; bytes once media_fetch fetched a URL.
    image_data: tuple[str | bytes, ...] | None = None
    no_logs: bool = False
    health_check: bool = False
    cache_salt: str | None = None
    custom_logit_processor: str | None = None
    token_ids_logprob: tuple[int, ...] | None = None  # score these ids at each logprob position
