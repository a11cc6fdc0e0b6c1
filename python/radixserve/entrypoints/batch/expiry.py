"""Files expire as OpenAI's do: an upload's `expires_after` ({"anchor": "created_at", "seconds":
3600..2592000}), 30 days by default for purpose "batch"; a batch's `output_expires_after` for its
output and error files (kept until deleted without it). An expired file is deleted: GET, content,
list and a batch naming it answer as for an id that never existed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.entrypoints.batch.multipart import FormField
from radixserve.managers.input_validation import InvalidRequestError

MIN_EXPIRES_S = 3600  # OpenAI's bounds: one hour ...
MAX_EXPIRES_S = 30 * 24 * 3600  # ... to thirty days
DEFAULT_BATCH_FILE_EXPIRES_S = MAX_EXPIRES_S  # purpose "batch" without expires_after


class ExpiresAfter(BaseModel):
    """OpenAI's FileExpirationAfter / BatchFileExpirationAfter (the anchor is the file's creation)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRES_S, le=MAX_EXPIRES_S)


def form_expires_after(form: dict[str, FormField]) -> int | None:
    """The seconds of a multipart upload's `expires_after[anchor]` / `expires_after[seconds]`
    (the openai client's encoding of the nested object), None when the upload has neither."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        if any(name.startswith("expires_after") for name in form):
            raise InvalidRequestError(
                "expires_after: give it as expires_after[anchor] and expires_after[seconds]."
            )
        return None
    if anchor is None or seconds is None:
        raise InvalidRequestError("expires_after: both anchor ('created_at') and seconds are required.")
    anchor_text = anchor.value.decode("utf-8", "replace")
    if anchor_text != "created_at":
        raise InvalidRequestError(
            f"expires_after.anchor: {anchor_text!r} is not supported; use 'created_at'."
        )
    try:
        value = int(seconds.value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidRequestError("expires_after.seconds: an integer is required.") from None
    if not MIN_EXPIRES_S <= value <= MAX_EXPIRES_S:
        raise InvalidRequestError(
            f"expires_after.seconds: {value} is outside [{MIN_EXPIRES_S}, {MAX_EXPIRES_S}] (one hour to 30 days)."
        )
    return value
