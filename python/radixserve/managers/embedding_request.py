"""Requests that finish at prefill (seed 000 §17): the native /encode and /classify body
(SGLang's EmbeddingReqInput) and its items, and the tokenization that runs off the event loop.

One item is one scheduler request: a text or token ids, optionally a second text (the document
of a (query, document) pair, whose tokens get segment id 1 on BERT-style tokenizers), optionally
label token ids (score those next tokens instead of pooling; /v1/score and yes/no rerankers).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve.managers.generate_request import MAX_RID_LEN
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per /v1/embeddings call


class EmbeddingReqInput(BaseModel):
    """SGLang's /encode (and /classify) body: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    priority: int | None = None
    dimensions: int | None = None  # Matryoshka models: keep the first `dimensions` values
    # Keep the first k tokens of a longer input (-1: as many as the model takes); unset, a longer
    # input is refused.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return not (self.input_ids and isinstance(self.input_ids[0], list))

    def items(self) -> list[EmbedItem]:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("Exactly one of 'text' and 'input_ids' must be given.")
        inputs: list[Any]
        if self.text is not None:
            inputs = [self.text] if isinstance(self.text, str) else list(self.text)
        else:
            inputs = [self.input_ids] if self.is_single else list(self.input_ids or [])
        rids = _rids(self.rid, len(inputs), self.is_single)
        return [
            make_item(x, rid, self.truncate_prompt_tokens, priority=self.priority)
            for x, rid in zip(inputs, rids)
        ]


def _rids(rid: str | list[str] | None, n: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if isinstance(rid, str) and not single:
        raise InvalidRequestError("'rid' must be a list with one id per input for a batch.")
    if len(rids) != n:
        raise InvalidRequestError(f"'rid' has {len(rids)} entries for {n} inputs.")
    if len(set(rids)) != n:
        raise InvalidRequestError("Duplicate request id in one request.")
    if any(len(r) > MAX_RID_LEN for r in rids):
        raise InvalidRequestError(f"A request id is at most {MAX_RID_LEN} characters.")
    return rids


@dataclass(frozen=True)
class EmbedItem:
    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    text_pair: str | None = None  # the second segment of a cross-encoder pair
    label_token_ids: list[int] | None = None
    truncate: int | None = None  # see EmbeddingReqInput.truncate_prompt_tokens
    priority: int | None = None


def make_item(
    value: Any,  # noqa: ANN401 - a text or a list of token ids
    rid: str | None = None,
    truncate: int | None = None,
    *,
    text_pair: str | None = None,
    label_token_ids: list[int] | None = None,
    priority: int | None = None,
) -> EmbedItem:
    rid = rid or uuid.uuid4().hex
    if isinstance(value, str):
        return EmbedItem(
            rid,
            text=value,
            text_pair=text_pair,
            label_token_ids=label_token_ids,
            truncate=truncate,
            priority=priority,
        )
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return EmbedItem(
            rid, input_ids=list(value), label_token_ids=label_token_ids, truncate=truncate, priority=priority
        )
    raise InvalidRequestError("Each input must be a string or a list of token ids.")


def check_batch_size(n: int) -> None:
    if n == 0:
        raise InvalidRequestError("The input is empty: give at least one string or token list.")
    if n > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"At most {MAX_EMBEDDING_INPUTS} inputs per request, got {n}.")


def prepare_embedding_items(
    tokenizer: Any,  # noqa: ANN401 - any HF tokenizer
    limits: ModelLimits,
    items: list[EmbedItem],
) -> list[tuple[list[int], list[int] | None]]:
    """(input_ids, token_type_ids or None) per item, checked against the model; raises 400s."""
    out = []
    for item in items:
        ids, types = _tokenize(tokenizer, item)
        if not ids:
            raise InvalidRequestError("The input is empty: an input needs at least one token.")
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise InvalidRequestError(f"Token ids must be in [0, {limits.vocab_size}).")
        if item.label_token_ids is not None and any(
            not 0 <= t < limits.vocab_size for t in item.label_token_ids
        ):
            raise InvalidRequestError(f"label_token_ids must be in [0, {limits.vocab_size}).")
        limit = limits.max_req_input_len + 1  # no output token: the whole context is the input's
        if len(ids) > limit:
            if item.truncate is None:
                raise InvalidRequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's maximum input length "
                    f"({limit} tokens); shorten it or set truncate_prompt_tokens."
                )
        if item.truncate is not None:
            keep = limit if item.truncate == -1 else min(item.truncate, limit)
            if keep <= 0:
                raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1.")
            ids, types = ids[:keep], (types[:keep] if types is not None else None)
        out.append((ids, types))
    return out


def _tokenize(tokenizer: Any, item: EmbedItem) -> tuple[list[int], list[int] | None]:  # noqa: ANN401
    if item.input_ids is not None:
        return list(item.input_ids), None
    if item.text == "" or item.text_pair == "":
        raise InvalidRequestError("The input is empty: an input string must not be empty.")
    if item.text_pair is None:
        return list(tokenizer.encode(item.text or "")), None
    enc = tokenizer(item.text, item.text_pair, return_token_type_ids=True)
    types = list(enc.get("token_type_ids") or [])
    return list(enc["input_ids"]), (types if any(types) else None)
