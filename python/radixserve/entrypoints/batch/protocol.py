"""The objects of OpenAI's Files and Batch APIs, with OpenAI's field names and status values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.entrypoints.batch.expiry import ExpiresAfter
from radixserve.entrypoints.openai.protocol import ListPage

# The routes a batch line may call (OpenAI's `url`, the batch's `endpoint`).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# A batch in one of these is still owned by the runner (resumed after a restart).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the only window OpenAI accepts


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(ListPage):
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # for the output and error files


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchInputTokensDetails(BaseModel):
    cached_tokens: int = 0


class BatchOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's batch usage: the sums over the lines that completed."""

    input_tokens: int = 0
    input_tokens_details: BatchInputTokensDetails = Field(default_factory=BatchInputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: BatchOutputTokensDetails = Field(default_factory=BatchOutputTokensDetails)
    total_tokens: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    metadata: dict[str, str] | None = None
    model: str | None = None


class BatchList(ListPage):
    data: list[BatchObject]


class BatchLine(BaseModel):
    """One line of a batch input file (what jsonl.py accepts)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def file_object(
    file_id: str, filename: str, purpose: str, content: bytes, created_at: int, expires_s: int | None = None
) -> dict[str, Any]:
    return FileObject(
        id=file_id,
        bytes=len(content),
        created_at=created_at,
        filename=filename,
        purpose=purpose,  # type: ignore[arg-type]
        expires_at=None if expires_s is None else created_at + expires_s,
    ).model_dump(mode="json")
