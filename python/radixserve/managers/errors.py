"""Errors the main process's request paths raise toward the HTTP edge and the Engine."""

from __future__ import annotations


class RequestAbortedError(RuntimeError):
    """A request the server could not serve; `status_code` is the HTTP status to answer."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code


class ClientDisconnected(Exception):
    """The HTTP client of a waiting call went away; its requests were aborted (logged once)."""


class StoredObjectNotFound(LookupError):
    """No stored object (a response, a file, a batch) has the id a route names: HTTP 404, type
    not_found (one handler in entrypoints/http_errors.py)."""
