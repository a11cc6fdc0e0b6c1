"""What every request passes before a route runs: the Host check, the API key, the body rules.

A server on 127.0.0.1 without --api-key is reachable from any web page the user opens, so:

- **Host** (DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 talks to us as
  "same origin"): the Host header must name the bind address, unless --allowed-hosts widens it.
- **Content-Type** on every POST/PUT route: only `application/json` (`require_json_body`, a
  dependency of the whole app, so no route can leave it out). A cross-site page can send
  text/plain or a form without a CORS preflight, but not JSON; the preflight (OPTIONS) is never
  approved here.
- **Body size**: a body over --max-request-body-bytes is refused (413) before it is read.
- **File uploads** (`MULTIPART_PATHS`, OpenAI's POST /v1/files) take multipart/form-data, which a
  page can send cross-site; so only without an Origin header (SDKs and curl send none, a
  browser always does on a POST).

docs/http_api.md ("Security") states the rules for users.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.entrypoints.dashboard.assets import PUBLIC_ASSET_PATHS
from radixserve.entrypoints.openai.protocol import error_body, error_type

BodyT = TypeVar("BodyT", bound=BaseModel)

# No API key needed: health, metrics, and the dashboard's static files (no data; dashboard/assets.py).
PUBLIC_PATHS = ("/health", "/metrics", *PUBLIC_ASSET_PATHS)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def error_response(status: int, message: str, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, error_type(status), code if code is not None else status), status_code=status
    )


# ----------------------------------------------------------------------------- Host
def allowed_host_names(bind_host: str, allowed_hosts: str | None) -> frozenset[str] | None:
    """The names (no port) the Host header may carry; None accepts any.

    A specific bind address accepts itself (and the loopback names when it is a loopback address)
    plus --allowed-hosts. A wildcard bind (0.0.0.0, ::) cannot know the names it is reached by:
    any Host is accepted unless --allowed-hosts lists them (the bind address and the loopback
    names, which the start-up warm-up and local probes use, stay allowed). "*" accepts any."""
    extra = {_normalize(h) for h in (allowed_hosts or "").split(",") if h.strip()}
    if "*" in extra:
        return None
    bind = _normalize(bind_host)
    if bind in WILDCARD_BINDS:
        return frozenset(extra | LOOPBACK_NAMES | {bind}) if extra else None
    names = {bind} | extra
    if bind == "localhost" or _is_loopback(bind):
        names |= LOOPBACK_NAMES
    return frozenset(names)


def host_name(header: str) -> str:
    """The name part of a Host header: "[::1]:30000" -> "::1", "Example.COM:80" -> "example.com"."""
    header = header.strip()
    if header.startswith("["):
        return _normalize(header[1 : header.find("]")] if "]" in header else header[1:])
    name, sep, port = header.rpartition(":")
    return _normalize(name if sep and port.isdigit() else header)


def _normalize(name: str) -> str:
    name = name.strip().lower().rstrip(".")
    return name[1:-1] if name.startswith("[") and name.endswith("]") else name


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class GuardMiddleware:
    """Pure ASGI (so streaming responses pass through untouched): Host check, then the API key."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None, api_key: str | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        # No Host at all is an HTTP/1.0 client, never a browser: nothing to rebind.
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            return error_response(
                400,
                f"Host '{host}' is not allowed; start the server with --allowed-hosts to accept it.",
            )
        if (
            self.api_key
            and scope["path"] not in PUBLIC_PATHS
            and not bearer_matches(headers.get("authorization"), self.api_key)
            and not x_api_key_matches(headers.get("x-api-key"), self.api_key)
        ):
            return error_response(401, "Incorrect API key provided.", "invalid_api_key")
        return None


def bearer_matches(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer <key>` with the scheme in any case (RFC 7235: auth schemes are
    case-insensitive) and any whitespace around the scheme and the key; the key itself is compared
    exactly, in constant time."""
    parts = (header or "").split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].strip().encode(), api_key.encode())


def x_api_key_matches(header: str | None, api_key: str) -> bool:
    """`x-api-key: <key>`, the header Anthropic's clients send their key in."""
    return header is not None and hmac.compare_digest(header.strip().encode(), api_key.encode())


# ----------------------------------------------------------------------------- bodies
def is_json_type(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters (charset) ignored."""
    if content_type is None:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
MULTIPART_PATHS = frozenset({"/v1/files"})  # routes whose body is multipart/form-data


def is_multipart_upload(request: Request) -> bool:
    """A form upload to a MULTIPART_PATHS route, not sent by a browser page (no Origin)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return (
        media == "multipart/form-data"
        and request.scope["path"] in MULTIPART_PATHS
        and "origin" not in request.headers
    )


def _has_body(headers: Headers) -> bool:
    """HTTP/1.1 frames a request body with Content-Length or Transfer-Encoding; neither is none."""
    return headers.get("content-length", "0").strip() != "0" or "transfer-encoding" in headers


async def require_json_body(request: Request) -> None:
    """Every POST/PUT takes JSON only (a cross-site page cannot send it without a preflight).

    A request with no body, no Content-Type and no Origin passes (`curl -X POST url`, SDKs): a
    browser sends Origin on every POST, so a page cannot make one. A route that needs a body then
    refuses the empty one with a 400."""
    if request.method not in BODY_METHODS:
        return
    headers = request.headers
    if is_json_type(headers.get("content-type")) or is_multipart_upload(request):
        return
    if "content-type" not in headers and "origin" not in headers and not _has_body(headers):
        return
    raise HTTPException(
        415,
        f"This route needs 'Content-Type: application/json' (got {headers.get('content-type', 'none')}); "
        "with curl, add -H 'Content-Type: application/json' or use --json.",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = HTTPException(
        413, f"The request body is larger than {limit} bytes (--max-request-body-bytes)."
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large  # before reading a byte
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(model: type[BodyT], request: Request) -> BodyT:
    """The body parsed strictly as `model`: a wrong JSON type ("yes" for a bool, "10" for an int)
    or NaN/Infinity is a ValidationError (400). The Content-Type was checked by require_json_body."""
    body = await read_body(request, request.app.state.max_body_bytes)
    return model.model_validate_json(body, strict=True)
