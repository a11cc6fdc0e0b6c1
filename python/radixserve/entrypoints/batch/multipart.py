"""multipart/form-data bodies (POST /v1/files), read with the stdlib email parser: the server does
not depend on python-multipart for one route. The body was already read within
--max-request-body-bytes."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP

from radixserve.managers.input_validation import InvalidRequestError


@dataclass(frozen=True)
class FormField:
    value: bytes
    filename: str | None  # set for a file part


def parse_form(content_type: str, body: bytes) -> dict[str, FormField]:
    """The parts of a multipart/form-data body by name (a repeated name: the first part)."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.get_content_type() != "multipart/form-data":
        raise InvalidRequestError("The body must be multipart/form-data with a boundary.")
    fields: dict[str, FormField] = {}
    for part in message.iter_parts():
        name = _param(part, "name")
        if name is None or name in fields:
            continue
        payload = part.get_payload(decode=True)
        fields[name] = FormField(payload if isinstance(payload, bytes) else b"", _param(part, "filename"))
    return fields


def _param(part: Message, key: str) -> str | None:
    value = part.get_param(key, header="content-disposition")
    if value is None:
        return None
    return value if isinstance(value, str) else str(value[2])  # RFC 2231 (charset, lang, text)
