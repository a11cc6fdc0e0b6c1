"""A forgiving scanner for one tool-call JSON object in a text that may still be growing.

`scan_call(text, start)` reports what is certain so far about the object starting at `start`
(`text[start] == "{"`): the function name once its string is complete, where the arguments value
starts and (once closed) ends, and where the object ends. It never raises: incomplete or odd input
just leaves fields None, which is what a streaming parser needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEYS = frozenset({"name"})
ARG_KEYS = frozenset({"arguments", "parameters"})
_WS = " \t\r\n"


@dataclass
class CallScan:
    name: str | None = None
    args_start: int | None = None  # index of the arguments value's first character
    args_end: int | None = None  # index after its last character (None: not closed yet)
    end: int | None = None  # index after the object's closing brace (None: not closed yet)


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at text[i] == '"', or None if it is not closed yet."""
    j = i + 1
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _decode(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def scan_call(text: str, start: int) -> CallScan:
    scan = CallScan()
    depth = 0
    key: str | None = None
    value_key: str | None = None  # the depth-1 key whose value is being read
    expecting_key = True
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = string_end(text, i)
            if j is None:
                break
            if depth == 1 and expecting_key:
                key = _decode(text[i:j])
            elif depth == 1 and value_key in NAME_KEYS:
                scan.name = _decode(text[i:j])
            elif depth == 1 and value_key in ARG_KEYS:
                scan.args_end = j  # arguments given as a JSON string
            i = j
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and value_key in ARG_KEYS and scan.args_end is None:
                scan.args_end = i + 1
            if depth == 0:
                if value_key in ARG_KEYS and scan.args_end is None:
                    scan.args_end = _trim_end(text, i)  # a bare number/literal value
                scan.end = i + 1
                return scan
        elif c == ":" and depth == 1:
            expecting_key, value_key = False, key
            k = i + 1
            while k < n and text[k] in _WS:
                k += 1
            if k < n and value_key in ARG_KEYS:
                scan.args_start = k
        elif c == "," and depth == 1:
            if value_key in ARG_KEYS and scan.args_end is None:
                scan.args_end = _trim_end(text, i)
            expecting_key, value_key = True, None
        i += 1
    return scan


def _trim_end(text: str, i: int) -> int:
    while i > 0 and text[i - 1] in _WS:
        i -= 1
    return i
