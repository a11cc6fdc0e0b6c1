"""Embeddings, label scores, reranking and classification on top of TokenizerManager.encode_items:
the logic the HTTP routes and the Engine share.

- embed: vectors, optionally cut to `dimensions` (Matryoshka models) and re-normalised;
- score (/v1/score, SGLang's shape): for each item, the probabilities of `label_token_ids` as the
  next token after query+item (or item+query), renormalised over the labels with apply_softmax;
- rerank (/v1/rerank): a cross-encoder (a sequence classifier with one label, served as an
  embedding model) scores (query, document) pairs with sigmoid(logit); on a generation model,
  a Qwen3-Reranker-style prompt is scored by P("yes") against "no" at the next token;
- classify: a classifier's logits, softmaxed into probabilities with the arg-max label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from radixserve.managers.embedding_request import EmbedItem, check_batch_size, make_item
from radixserve.managers.input_validation import InvalidRequestError

if TYPE_CHECKING:
    from radixserve.managers.tokenizer_manager import ClientRequest, TokenizerManager

# The prompt Qwen3-Reranker was trained with (its model card): a yes/no judgement.
QWEN3_RERANK_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
_QWEN3_RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _raise_if_failed(outputs: list[dict[str, Any]]) -> None:
    from radixserve.managers.tokenizer_manager import RequestAbortedError

    for out in outputs:
        reason = out["meta_info"]["finish_reason"] or {}
        if reason.get("type") == "abort" or out["embedding"] is None:
            status = reason.get("status_code") or 503
            raise RequestAbortedError(reason.get("message", "Request aborted."), int(status))


async def run(tm: TokenizerManager, items: list[EmbedItem], request: ClientRequest | None) -> list[dict]:
    check_batch_size(len(items))
    outputs = await tm.encode_items(items, request)
    _raise_if_failed(outputs)
    return outputs


# ------------------------------------------------------------------------------------ embeddings
def check_dimensions(tm: TokenizerManager, dimensions: int | None) -> None:
    if dimensions is None:
        return
    info = tm.embedding_info or {}
    allowed = info.get("matryoshka_dimensions")
    if allowed is None:
        raise InvalidRequestError(
            "This model does not support matryoshka representation: 'dimensions' cannot be set."
        )
    size = int(info.get("num_labels") or 0) if info.get("is_classifier") else int(info.get("hidden_size", 0))
    if not 1 <= dimensions <= size or (allowed and dimensions not in allowed):
        choices = list(allowed) if allowed else f"1..{size}"
        raise InvalidRequestError(f"'dimensions' must be one of {choices}, got {dimensions}.")


def cut_dimensions(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` values, re-normalised when the model's vectors are (Matryoshka)."""
    if dimensions is None:
        return vector
    head = np.asarray(vector, dtype=np.float32)[:dimensions]
    if not normalize:
        return head
    norm = float(np.linalg.norm(head.astype(np.float64))) or 1.0
    return (head.astype(np.float64) / norm).astype(np.float32)


async def embed(
    tm: TokenizerManager,
    items: list[EmbedItem],
    dimensions: int | None = None,
    request: ClientRequest | None = None,
) -> list[dict]:
    check_dimensions(tm, dimensions)
    outputs = await run(tm, items, request)
    normalize = bool((tm.embedding_info or {}).get("normalize"))
    for out in outputs:
        out["embedding"] = cut_dimensions(out["embedding"], dimensions, normalize)
    return outputs


# ------------------------------------------------------------------------------------ scoring
async def score(
    tm: TokenizerManager,
    query: str | list[int] | None,
    items: str | list[str] | list[list[int]],
    label_token_ids: list[int],
    apply_softmax: bool = False,
    item_first: bool = False,
    request: ClientRequest | None = None,
) -> tuple[list[list[float]], int]:
    """(scores per item, prompt tokens in all)."""
    if not label_token_ids:
        raise InvalidRequestError("'label_token_ids' must name at least one token.")
    item_list: list[Any] = [items] if isinstance(items, str) else list(items)
    prompts = [_join(query, item, item_first) for item in item_list]
    outputs = await run(tm, [make_item(p, label_token_ids=list(label_token_ids)) for p in prompts], request)
    scores = []
    for out in outputs:
        logprobs = [float(x) for x in out["embedding"]]
        if apply_softmax:
            scores.append(_softmax(logprobs))
        else:
            scores.append([math.exp(lp) for lp in logprobs])
    return scores, sum(o["meta_info"]["prompt_tokens"] for o in outputs)


def _join(query: str | list[int] | None, item: Any, item_first: bool) -> str | list[int]:  # noqa: ANN401
    if query is None:
        return item
    if isinstance(query, str) != isinstance(item, str):
        raise InvalidRequestError("'query' and 'items' must both be text or both be token ids.")
    return item + query if item_first else query + item


# ------------------------------------------------------------------------------------ rerank
async def rerank(
    tm: TokenizerManager,
    query: str,
    documents: list[str],
    instruct: str | None = None,
    request: ClientRequest | None = None,
) -> list[tuple[float, dict[str, Any]]]:
    """(score, meta_info) per document, in the documents' order."""
    if not documents:
        raise InvalidRequestError("'documents' must hold at least one document.")
    if not query:
        raise InvalidRequestError("'query' must not be empty.")
    if tm.is_generation:
        yes, no = _yes_no_ids(tm)
        body = f"<Instruct>: {instruct or QWEN3_RERANK_INSTRUCT}\n<Query>: {query}\n<Document>: "
        prompts = [f"{_QWEN3_RERANK_PREFIX}{body}{doc}{_QWEN3_RERANK_SUFFIX}" for doc in documents]
        outputs = await run(tm, [make_item(p, label_token_ids=[yes, no]) for p in prompts], request)
        # P(yes) over {yes, no}: the softmax of the two logits.
        return [
            (sigmoid(float(o["embedding"][0]) - float(o["embedding"][1])), o["meta_info"]) for o in outputs
        ]
    info = tm.embedding_info or {}
    if not info.get("is_classifier") or int(info.get("num_labels", 0)) != 1:
        raise InvalidRequestError(
            "Reranking needs a cross-encoder (a sequence classifier with one label) or a generation "
            "model scored by yes/no (Qwen3-Reranker); this model is neither."
        )
    outputs = await run(tm, [make_item(query, text_pair=doc) for doc in documents], request)
    return [(sigmoid(float(o["embedding"][0])), o["meta_info"]) for o in outputs]


def _yes_no_ids(tm: TokenizerManager) -> tuple[int, int]:
    ids = [tm.tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no")]
    if any(len(i) != 1 for i in ids):
        raise InvalidRequestError(
            "Reranking with a generation model needs 'yes' and 'no' to be single tokens of its "
            "vocabulary (a Qwen3-Reranker-style model)."
        )
    return ids[0][0], ids[1][0]


# ------------------------------------------------------------------------------------ classify
def classification(logits: Sequence[float], id2label: dict[int, str]) -> dict[str, Any]:
    probs = _softmax([float(x) for x in logits])
    best = max(range(len(probs)), key=probs.__getitem__)
    return {"label": id2label.get(best, f"LABEL_{best}"), "probs": probs, "num_classes": len(probs)}


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow: math.exp of a large argument (> ~709) raises."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(x - top) for x in values]
    total = sum(exps)  # once, not once per element
    return [e / total for e in exps]
