"""One batch line, run through the same handlers as its HTTP route (no HTTP loopback), with the
batch priority; its answer or its error becomes the line's `response` in OpenAI's shape."""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from typing import Any

from pydantic import BaseModel, ValidationError

from radixserve.entrypoints import embedding_routes
from radixserve.entrypoints.http_errors import validation_message
from radixserve.entrypoints.openai.embedding_protocol import EmbeddingRequest
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    error_type,
)
from radixserve.entrypoints.openai.serving_chat import ChatHandler
from radixserve.entrypoints.openai.serving_common import (
    ModelNotFoundError,
    check_model,
    internal_error_message,
)
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.managers import scoring
from radixserve.managers.errors import RequestAbortedError
from radixserve.managers.io_struct import BATCH_PRIORITY
from radixserve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# Statuses after which a line is tried again later rather than failed: the server refused it for
# now (a full queue, a restart of the children), not because of what it asks.
RETRY_STATUSES = frozenset({503})


@dataclasses.dataclass(frozen=True)
class LineOutcome:
    status_code: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


class LineRunner:
    """Runs a line's body against its route's handler."""

    def __init__(
        self,
        tm: TokenizerManager,
        chat: ChatHandler,
        completions: CompletionsHandler,
        served: tuple[str, ...],
    ) -> None:
        self.tm = tm
        self.chat = chat
        self.completions = completions
        self.served_names = served

    async def run(self, url: str, body: dict[str, Any]) -> LineOutcome:
        try:
            return LineOutcome(200, await self._call(url, body))
        except ValidationError as exc:
            return _error(400, validation_message(exc))
        except ModelNotFoundError as exc:
            return _error(404, str(exc.args[0]), "model_not_found")
        except RequestAbortedError as exc:
            return _error(exc.status_code, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - the server's fault: this line fails, the batch goes on
            logger.exception("Unhandled %s in a batch line to %s", type(exc).__name__, url)
            return _error(500, internal_error_message(exc))

    async def _call(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        # The HTTP routes validate the raw JSON strictly; the same bytes are validated here.
        raw = json.dumps(body)
        if url == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate_json(raw, strict=True)
            return _dump(await self.chat.create(chat, None, priority=BATCH_PRIORITY))
        if url == "/v1/completions":
            completion = CompletionRequest.model_validate_json(raw, strict=True)
            return _dump(await self.completions.create(completion, None, priority=BATCH_PRIORITY))
        if url == "/v1/embeddings":
            return await self._embeddings(EmbeddingRequest.model_validate_json(raw, strict=True))
        raise ValueError(f"url {url!r} is not a batch endpoint.")  # jsonl.py let it through: a bug

    async def _embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        check_model(req.model, self.served_names)
        items = [
            dataclasses.replace(item, priority=BATCH_PRIORITY)
            for item in embedding_routes.embedding_items(req.input, req.truncate_prompt_tokens)
        ]
        outputs = await scoring.embed(self.tm, items, req.dimensions)
        model = req.model or self.tm.served_model_name
        return json.loads(embedding_routes.embeddings_body(outputs, req.encoding_format, model))


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


def _error(status: int, message: str, code: str | None = None) -> LineOutcome:
    return LineOutcome(status, error_body(message, error_type(status), code if code is not None else status))


def output_line(custom_id: str, outcome: LineOutcome) -> dict[str, Any]:
    """A line of the output (or error) file: the request's answer, whatever its status."""
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": {
            "status_code": outcome.status_code,
            "request_id": secrets.token_hex(16),
            "body": outcome.body,
        },
        "error": None,
    }


def unrun_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """An error-file line for a request that never ran (the batch expired or was cancelled)."""
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
