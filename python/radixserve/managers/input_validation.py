"""Every check a request meets after its body parsed, in one layer (400s with the reason).

`expand_generate` refuses what the server cannot serve (the model kind, a replica it does not
run); `prepare_items` turns a generate call's items into validated token ids, the TokenizerManager's
CPU-heavy step (embedding items: `embedding_request.prepare_embedding_items`). The scheduler trusts
what passed here.

It runs on the TokenizerManager's tokenizer threads, never on the event loop: a prompt of a few
megabytes takes about a second to tokenize (the tokenizer releases the GIL meanwhile), and /health
and every other request must not wait for it. Nothing here touches the manager's per-request
state or its sockets, which belong to the event loop's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.constrained.validation import validate_grammar
from radixserve.managers.generate_request import GenerateReqInput, RequestItem
from radixserve.managers.io_struct import MultimodalPayload
from radixserve.multimodal.processor import TEXT_ONLY, BadImageError, ImageInputProcessor, image_refusal
from radixserve.sampling.custom_logit_processor import load_processor

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against (reported by the scheduler at start-up)."""

    vocab_size: int
    context_len: int
    max_req_input_len: int
    is_generation: bool = True
    dp_size: int = 1
    disaggregation_mode: str = "null"
    allow_auto_truncate: bool = False  # --allow-auto-truncate: cut instead of refusing
    enable_return_hidden_states: bool = False  # --enable-return-hidden-states
    hidden_size: int = 0  # what each input_embeds row must hold (0: unknown, none accepted)
    enable_custom_logit_processor: bool = False
    custom_logit_processor_modules: tuple[str, ...] = ()
    image_refusal: str | None = TEXT_ONLY  # why image_data is refused (None: the model takes images)

    @classmethod
    def of(
        cls,
        server_args: Any,  # noqa: ANN401 - ServerArgs (not imported: managers stay light)
        scheduler_info: dict[str, Any],
        vocab_size: int,
        images: ImageInputProcessor | None,
    ) -> ModelLimits:
        """The limits of a server, from its args and what its scheduler reported at start-up."""
        context_len = int(scheduler_info["context_len"])
        return cls(
            vocab_size,
            context_len,
            int(scheduler_info.get("max_req_input_len", context_len - 1)),
            bool(scheduler_info.get("is_generation", True)),
            server_args.dp_size,
            server_args.disaggregation_mode,
            server_args.allow_auto_truncate,
            server_args.enable_return_hidden_states,
            int(scheduler_info.get("hidden_size", 0)),
            server_args.enable_custom_logit_processor,
            tuple(server_args.custom_logit_processor_modules),
            image_refusal(server_args, images),
        )


def expand_generate(limits: ModelLimits, obj: GenerateReqInput) -> list[RequestItem]:
    """The call's items (`expand` checks the body alone), refused if this model cannot generate
    or a replica asked for does not exist; raises InvalidRequestError / ValueError (both 400)."""
    if not limits.is_generation:
        raise InvalidRequestError(
            "This model is an embedding/classification model and cannot generate: use "
            "/v1/embeddings, /encode or /classify."
        )
    items = obj.expand()
    if any(item.return_hidden_states for item in items):
        _check_hidden_states(limits)
    if any(item.input_embeds is not None for item in items):
        _check_embeds_request(limits, items)
    if any(item.image_data is not None for item in items):
        _check_image_request(limits, items)
    for spec in {item.custom_logit_processor for item in items} - {None}:
        check_custom_logit_processor(limits, spec)
    _check_token_ids_logprob(limits, items)
    routed = items[0].routed_dp_rank if items else None
    if routed is not None and routed >= limits.dp_size:
        raise InvalidRequestError(
            f"routed_dp_rank {routed} is out of range: the server runs {limits.dp_size} "
            f"data-parallel replica(s) (--dp-size), ranks 0 to {limits.dp_size - 1}."
        )
    # On a prefill server the rank names one of its own replicas; on a decode server it names
    # the prefill server's, which only its bootstrap server knows (checked there).
    prefill_rank = items[0].routing.disagg_prefill_dp_rank if items else None
    if (
        prefill_rank is not None
        and limits.disaggregation_mode == "prefill"
        and prefill_rank >= limits.dp_size
    ):
        raise InvalidRequestError(
            f"disagg_prefill_dp_rank {prefill_rank} is out of range: this prefill server runs "
            f"{limits.dp_size} data-parallel replica(s) (--dp-size), ranks 0 to {limits.dp_size - 1}."
        )
    return items


def _check_token_ids_logprob(limits: ModelLimits, items: list[RequestItem]) -> None:
    """token_ids_logprob's ids must be in the vocabulary; a disaggregated pair does not carry them
    from the prefill to the decode server, so it refuses the field rather than drop it."""
    for item in items:
        if item.token_ids_logprob is None:
            continue
        if limits.disaggregation_mode != "null":
            raise InvalidRequestError(
                "token_ids_logprob is not supported with prefill/decode disaggregation."
            )
        bad = [t for t in item.token_ids_logprob if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token_ids_logprob ids must be in [0, {limits.vocab_size}), got {bad[:5]}."
            )


def _check_hidden_states(limits: ModelLimits) -> None:
    if not limits.enable_return_hidden_states:  # SGLang's rule: the operator opts in
        raise InvalidRequestError(
            "The server is not configured to return the hidden states: start it with "
            "--enable-return-hidden-states."
        )
    if limits.disaggregation_mode != "null":
        # The prompt's rows are computed on the prefill server and never sent with the KV.
        raise InvalidRequestError("return_hidden_states is not supported with prefill/decode disaggregation.")


def check_custom_logit_processor(limits: ModelLimits, spec: str) -> None:
    """SGLang's rule (the operator opts in), then the processor must load (read, never unpickled)."""
    if not limits.enable_custom_logit_processor:
        raise InvalidRequestError(
            "The server is not configured to enable custom logit processors: start it with "
            "--enable-custom-logit-processor."
        )
    try:
        load_processor(spec, limits.custom_logit_processor_modules)
    except ValueError as exc:
        raise InvalidRequestError(f"Invalid custom_logit_processor: {exc}") from None


def _check_embeds_request(limits: ModelLimits, items: list[RequestItem]) -> None:
    """What input_embeds cannot serve: its prompt has no token ids to hand a PD pair's other side,
    to continue a session from, or to score and penalize."""
    if limits.disaggregation_mode != "null":
        raise InvalidRequestError("input_embeds is not supported with prefill/decode disaggregation.")
    for item in items:
        if item.session_params is not None:
            raise InvalidRequestError("input_embeds cannot continue a session (session_params).")
        if item.return_logprob and item.logprob_start_len >= 0:
            raise InvalidRequestError(
                "Prompt logprobs (logprob_start_len >= 0) need token ids, not input_embeds."
            )
        if item.sampling_params.repetition_penalty != 1.0:
            raise InvalidRequestError(
                "repetition_penalty counts prompt tokens, which input_embeds does not have."
            )


def _check_image_request(limits: ModelLimits, items: list[RequestItem]) -> None:
    """What images cannot be served with: a text-only model (or a mode not built for them yet);
    prompt logprobs and sessions, which read the prompt's ids (image tokens are pad values)."""
    if limits.image_refusal is not None:
        raise InvalidRequestError(f"'image_data' is not supported: {limits.image_refusal}.")
    for item in items:
        if item.image_data is None:
            continue
        if item.input_embeds is not None:
            raise InvalidRequestError("Give images with 'text' or 'input_ids', not with input_embeds.")
        if item.session_params is not None:
            raise InvalidRequestError("image_data cannot continue a session (session_params) yet.")
        if item.return_logprob and item.logprob_start_len >= 0:
            raise InvalidRequestError(
                "Prompt logprobs (logprob_start_len >= 0) are not returned with images."
            )


def embeds_prompt_ids(limits: ModelLimits, rows: list[list[float]]) -> list[int]:
    """Placeholder ids for an input_embeds prompt (one per row; the model reads the rows instead,
    and the request's KV is cached under its own namespace, so the ids never match another's)."""
    if not rows:
        raise InvalidRequestError("The input is empty.")
    bad = next((i for i, row in enumerate(rows) if len(row) != limits.hidden_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"input_embeds row {bad} has {len(rows[bad])} values; the model's hidden size is {limits.hidden_size}."
        )
    if len(rows) > limits.max_req_input_len:
        raise InvalidRequestError(
            f"The input ({len(rows)} embeddings) is longer than the model's context length "
            f"({limits.context_len} tokens)."
        )
    return [0] * len(rows)


def check_encode_kind(limits: ModelLimits, scoring: list[bool]) -> None:
    """Plain embeddings need an embedding model, label scores a generation model (its LM head)."""
    if any(scoring) and not limits.is_generation:
        raise InvalidRequestError(
            "Scoring label tokens needs a generation model (its next-token logits); this server "
            "runs an embedding/classification model."
        )
    if not all(scoring) and limits.is_generation:
        raise InvalidRequestError(
            "This model is a generation model and does not serve embeddings: start the server "
            "with --is-embedding (decoders trained for embeddings) or serve an embedding model."
        )


Prompt = tuple[list[int], MultimodalPayload | None]  # token ids, and the images if any


def prepare_items(tokenizer: Any, limits: ModelLimits, items: Sequence[RequestItem]) -> list[list[int]]:
    """Token ids per item of a call without images (prepare_prompts)."""
    return [ids for ids, _ in prepare_prompts(tokenizer, limits, items)]


def prepare_prompts(
    tokenizer: Any,
    limits: ModelLimits,
    items: Sequence[RequestItem],
    images: ImageInputProcessor | None = None,
) -> list[Prompt]:
    """Token ids (and images) per item (samples of one prompt share one tokenization and one
    processing of its images); raises ValueError.

    Also finishes each item's sampling params: verified, grammar checked, an unset max_new_tokens
    shrunk to fit the context, normalized. The items are private to this call, so mutating their
    params from a worker thread is safe."""
    by_prompt: dict[int, Prompt] = {}
    out = []
    for item in items:
        prompt = by_prompt.get(item.prompt_index)
        if prompt is None:
            prompt = by_prompt[item.prompt_index] = prompt_ids(tokenizer, limits, item, images)
        _check_item(limits, item, prompt[0])
        out.append(prompt)
    return out


def prompt_ids(
    tokenizer: Any, limits: ModelLimits, item: RequestItem, images: ImageInputProcessor | None = None
) -> Prompt:
    """Tokenize (or take) the prompt, expand its images, and check it against the model."""
    if item.input_embeds is not None:
        return embeds_prompt_ids(limits, item.input_embeds), None
    ids = list(item.input_ids) if item.input_ids is not None else tokenizer.encode(item.text or "")
    if not ids:
        raise InvalidRequestError("The input is empty.")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise InvalidRequestError(f"Token ids must be in [0, {limits.vocab_size}).")
    mm = None
    if item.image_data is not None:
        if images is None:  # expand_generate refuses first; an in-process caller may not have
            raise InvalidRequestError(f"'image_data' is not supported: {TEXT_ONLY}.")
        try:
            ids, mm = images.process(ids, item.image_data)
        except BadImageError as exc:
            raise InvalidRequestError(str(exc)) from None
    if len(ids) > limits.max_req_input_len:
        if (
            limits.allow_auto_truncate and mm is None
        ):  # SGLang's rule: keep the first tokens, room for one more
            logger.warning(
                "Input of %d tokens cut to %d (--allow-auto-truncate)", len(ids), limits.max_req_input_len
            )
            return ids[: limits.max_req_input_len], None
        raise InvalidRequestError(
            f"The input ({len(ids)} tokens{', images included' if mm else ''}) is longer than the "
            f"model's context length ({limits.context_len} tokens)."
        )
    return ids, mm


def _check_item(limits: ModelLimits, item: RequestItem, ids: list[int]) -> None:
    # SGLang's rule: prompt logprobs start inside the prompt (-1, the default, asks for none); it
    # is only checked when logprobs are asked for, as SGLang ignores the field otherwise.
    if item.return_logprob and item.logprob_start_len >= len(ids):
        raise InvalidRequestError(
            f"logprob_start_len ({item.logprob_start_len}) must be less than the number of input "
            f"tokens ({len(ids)}); -1 returns no prompt logprobs."
        )
    params = item.sampling_params
    params.verify(limits.vocab_size)
    validate_grammar(params)  # a bad json_schema / regex / ebnf is a 400 with the reason
    if len(ids) + params.max_new_tokens > limits.context_len:
        if item.max_new_tokens_set and not limits.allow_auto_truncate:
            raise InvalidRequestError(
                f"Requested token count exceeds the model's maximum context length of {limits.context_len} "
                f"tokens: {len(ids)} tokens from the input and {params.max_new_tokens} for the completion."
            )
        params.max_new_tokens = limits.context_len - len(ids)  # an unset budget fills the context
    params.normalize()
