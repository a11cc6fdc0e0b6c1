"""One log call, one log line: control characters in radixserve's log records are escaped.

Request strings (rid, session_id, lora_path, model names, prompts at --log-requests, header
values) reach log calls; a newline in one would let a client write a forged line ("...\\n[time]
INFO Weights updated") into the server log. Escaping at each call site is easy to forget, so the
escaping sits in the LogRecord factory, for every record of a `radixserve.*` logger (and
uvicorn's error logger, which logs the exceptions of the ASGI app), in every process, whatever
handlers and formatters are configured:

- the formatted message (args included, whatever their type, and an f-string message too) has its
  C0/C1 control characters and the Unicode line and paragraph separators written as escapes:
  "\\n", "\\r", "\\t", "\\x1b", "\\u2028" (a trusted multi-line message opts out with KEEP_LINES);
- a traceback stays multi-line (its frames come from the code), but each exception's own text,
  which may quote a request, is escaped.

`install()` runs when the package is imported (radixserve/__init__.py).
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable
from typing import Any

# The loggers whose records are escaped; uvicorn.access is left alone (its formatter builds the
# line from the record's args, and its HTTP parser refuses control characters in a request line).
ESCAPED_LOGGERS = ("radixserve", "uvicorn.error")

# C0 controls, DEL, C1 controls (U+0085 NEL is a line break to some log viewers) and U+2028/U+2029.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

# extra={KEEP_LINES: True} keeps a message's newlines: only for text that holds nothing from a
# request (the watchdog's dump of every thread's stack).
KEEP_LINES = "radixserve_keep_lines"

_installed = False


def escape_controls(text: str) -> str:
    """`text` with every control character written as a visible escape."""
    return _CONTROL.sub(_escape_one, text)


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _is_escaped_logger(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in ESCAPED_LOGGERS)


class EscapedLogRecord(logging.LogRecord):
    """A record whose message is escaped when a handler formats it (so `extra`, which logging
    sets after the factory ran, can still opt out: extra={KEEP_LINES: True})."""

    def getMessage(self) -> str:  # noqa: N802 - logging's name
        message = super().getMessage()
        return message if self.__dict__.get(KEEP_LINES) else escape_controls(message)


def escape_record(record: logging.LogRecord) -> None:
    """Make `record` escape its message, and escape its exception's text now."""
    if type(record) is logging.LogRecord:
        record.__class__ = EscapedLogRecord
    else:  # another library's record class: keep it, format and escape the message right away
        try:
            record.msg, record.args = escape_controls(record.getMessage()), None
        except Exception:  # a bad format string: let the handler report it as logging does
            pass
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        record.exc_text = format_exception_escaped(record.exc_info[1])


def format_exception_escaped(exc: BaseException) -> str:
    """The traceback as logging.Formatter.formatException writes it, with each chained
    exception's message (the part after "ValueError: ") escaped."""
    tb = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending = [tb]
    while pending:  # the __cause__ / __context__ chain, iteratively (it can be long)
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(getattr(item, "_str", None), str):  # CPython's exception-text slot
            item._str = escape_controls(item._str)
        pending.extend(x for x in (item.__cause__, item.__context__) if x is not None)
    return "".join(tb.format()).rstrip("\n")


def install() -> None:
    """Chain a LogRecord factory that escapes radixserve's records (idempotent; others untouched)."""
    global _installed
    if _installed:
        return
    previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if _is_escaped_logger(record.name):
            escape_record(record)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
