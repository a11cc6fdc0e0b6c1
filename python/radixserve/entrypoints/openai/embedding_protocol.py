"""Request and response models of the routes for models that do not generate: OpenAI's
/v1/embeddings, SGLang's /v1/rerank and /v1/score, and /v1/classify (vLLM's shape, as SGLang
serves it). Validation is strict like every other body (protocol.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from radixserve.entrypoints.openai.protocol import RequestModel, UsageInfo, random_id

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # Extension (as vLLM's): keep the first k tokens of a longer input, -1 the model's limit.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format=base64
    index: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: UsageInfo


class RerankRequest(RequestModel):
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruct: str | None = None  # the instruction of a yes/no reranker's prompt
    model: str | None = None


class RerankResult(BaseModel):
    score: float
    document: str | None = None
    index: int
    meta_info: dict[str, Any] | None = None


class ScoringRequest(RequestModel):
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class ScoringResponse(BaseModel):
    scores: list[list[float]]
    model: str
    usage: UsageInfo | None = None
    object: Literal["scoring"] = "scoring"


class ClassifyRequest(RequestModel):
    input: EmbeddingInput
    model: str | None = None
    user: str | None = None


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassifyData]
    usage: UsageInfo
