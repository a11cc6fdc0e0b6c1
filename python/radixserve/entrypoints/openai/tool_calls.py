"""Tool-call parsing for /v1/chat/completions: finds function calls in generated text, whole or
streamed, in the formats models are trained on.

Formats (`--tool-call-parser`):
- `hermes` (Qwen2.5/Qwen3, Hermes; aliases `qwen`, `qwen25`): text with any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `llama3`: the whole output is a call `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several calls may be separated by `;`.
- `json_array` (internal): `[{"name": ..., "arguments": {...}}, ...]`, what the grammar forces
  for tool_choice "required" or a named function.

One incremental state machine (`ToolCallStream`) serves both modes: streaming feeds the growing
text and emits content and call deltas as soon as they are certain; `parse()` feeds the whole text
once. A call whose JSON is malformed stays in the content (nothing the model wrote is lost).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from radixserve.entrypoints.openai.json_scan import CallScan, scan_call

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSER_ALIASES = {"hermes": "hermes", "qwen": "hermes", "qwen25": "hermes", "llama3": "llama3"}


@dataclass
class CallDelta:
    index: int  # the call's position among this choice's calls
    name: str | None  # set on the call's first delta only
    arguments: str  # the next piece of the arguments JSON text


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text


@dataclass
class _Call:
    start: int  # where its JSON object starts in the text
    raw_start: int  # where its markup starts (for putting a malformed call back into content)
    name_sent: bool = False
    args_sent: int = 0  # characters of the arguments text already emitted
    scan: CallScan | None = None
    args_text: str = ""


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: a marker that
    may be split across stream steps (held back until it is resolved)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallStream:
    fmt: str  # "hermes", "llama3" or "json_array"
    cursor: int = 0  # text before this is settled
    mode: str = "start"  # start | content | call | after_call
    calls: list[_Call] = field(default_factory=list)
    content: list[str] = field(default_factory=list)  # settled content pieces (for parse())
    malformed: list[tuple[int, int]] = field(default_factory=list)  # raw spans returned to content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """Process the whole text so far; returns (new content, new call deltas)."""
        out: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            progressed = getattr(self, f"_step_{self.mode}")(text, final, out, deltas)
            if not progressed:
                break
        if final and self.mode == "call":
            self._abandon_call(text, out)
        self.content.extend(out)
        return "".join(out), deltas

    # ------------------------------------------------------------------ modes
    def _step_start(self, text: str, final: bool, out: list[str], deltas: list[CallDelta]) -> bool:
        if self.fmt == "hermes":
            self.mode = "content"
            return True
        head = text[self.cursor :].lstrip()
        if self.fmt == "llama3" and head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        opener = "{" if self.fmt == "llama3" else "["
        if not head:
            if final:
                self.mode = "content"
                return True
            return False
        if self.fmt == "llama3" and PYTHON_TAG.startswith(head) and not final:
            return False
        if head[0] != opener:
            self.mode = "content"  # plain text: no call in this format
            return True
        pos = len(text) - len(head) + (0 if opener == "{" else 1)
        return self._open_call_at(text, pos, self.cursor, final)

    def _step_content(self, text: str, final: bool, out: list[str], deltas: list[CallDelta]) -> bool:
        rest = text[self.cursor :]
        if self.fmt != "hermes":
            if rest:
                out.append(rest)
                self.cursor = len(text)
            return False
        idx = rest.find(HERMES_START)
        if idx < 0:
            keep = 0 if final else partial_suffix(rest, HERMES_START)
            if len(rest) - keep > 0:
                out.append(rest[: len(rest) - keep])
                self.cursor += len(rest) - keep
            return False
        if idx:
            out.append(rest[:idx])
        raw_start = self.cursor + idx
        self.cursor = raw_start
        body = raw_start + len(HERMES_START)
        obj = body + (len(text[body:]) - len(text[body:].lstrip()))
        if obj >= len(text):
            return False  # the tag is complete, the JSON has not started yet
        if text[obj] != "{":
            out.append(text[raw_start:body])  # a stray tag: keep it as text
            self.cursor = body
            return True
        return self._open_call_at(text, obj, raw_start, final)

    def _open_call_at(self, text: str, obj: int, raw_start: int, final: bool) -> bool:
        self.calls.append(_Call(start=obj, raw_start=raw_start))
        self.cursor = obj
        self.mode = "call"
        return True

    def _step_call(self, text: str, final: bool, out: list[str], deltas: list[CallDelta]) -> bool:
        call = self.calls[-1]
        call.scan = scan_call(text, call.start)
        self._emit_call_deltas(call, text, deltas)
        if call.scan.end is None:
            return False
        self.cursor = call.scan.end
        if call.scan.name is None:  # a JSON object, but not a call: it and its tags stay text
            self._return_to_content(text, call, call.scan.end, out)
            self.mode = "content"
        else:
            self.mode = "after_call"
        return True

    def _step_after_call(self, text: str, final: bool, out: list[str], deltas: list[CallDelta]) -> bool:
        rest = text[self.cursor :]
        stripped = rest.lstrip()
        skipped = len(rest) - len(stripped)
        if self.fmt == "hermes":
            if stripped.startswith(HERMES_END):
                self.cursor += skipped + len(HERMES_END)
                after = text[self.cursor :]
                self.cursor += len(after) - len(after.lstrip())  # the newline between calls
            elif not final and (not stripped or HERMES_END.startswith(stripped)):
                return False  # the closing tag may still come
            self.mode = "content"
            return True
        separator = "," if self.fmt == "json_array" else ";"
        if not stripped:
            return False
        if stripped[0] == separator:
            after = stripped[1:].lstrip()
            if not after:
                return False
            if after[0] == "{":
                return self._open_call_at(text, len(text) - len(after), self.cursor, final)
        if self.fmt == "json_array" and stripped[0] == "]":
            self.cursor += skipped + 1
        self.mode = "content"
        return True

    # ------------------------------------------------------------------ calls
    def _emit_call_deltas(self, call: _Call, text: str, deltas: list[CallDelta]) -> None:
        scan = call.scan
        assert scan is not None
        if scan.name is None:
            return
        index = sum(1 for c in self.calls if c.name_sent and c is not call)
        args = _arguments_so_far(text, scan)
        if not call.name_sent:
            call.name_sent = True
            deltas.append(CallDelta(index, scan.name, ""))
        if args is not None and len(args) > call.args_sent:
            deltas.append(CallDelta(index, None, args[call.args_sent :]))
            call.args_sent = len(args)
        if scan.end is not None and scan.args_start is None and call.args_sent == 0:
            deltas.append(CallDelta(index, None, "{}"))  # a call without arguments
            call.args_sent = 2
        if args is not None:
            call.args_text = args

    def _return_to_content(self, text: str, call: _Call, end: int, out: list[str]) -> None:
        self.calls.remove(call)
        out.append(text[call.raw_start : end])
        self.malformed.append((call.raw_start, end))

    def _abandon_call(self, text: str, out: list[str]) -> None:
        """The text ended inside a call: it is not a call (its deltas, if any, were streamed)."""
        call = self.calls[-1]
        self.calls.remove(call)
        out.append(text[call.raw_start :])
        self.malformed.append((call.raw_start, len(text)))
        self.cursor = len(text)
        self.mode = "content"


def _arguments_so_far(text: str, scan: CallScan) -> str | None:
    """The arguments text that is certain: an object value streams as it grows; a string-encoded
    value (some models quote the JSON) is decoded once complete."""
    if scan.args_start is None:
        return None
    end = scan.args_end if scan.args_end is not None else len(text)
    raw = text[scan.args_start : end]
    if not raw.startswith("{"):
        if scan.args_end is None:
            return None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, str) else json.dumps(value)
    return raw


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ParsedCall]]:
    """Whole-text parse: (content without the calls, well-formed calls in order)."""
    stream = ToolCallStream(fmt)
    stream.feed(text, final=True)
    calls, content = [], "".join(stream.content)
    for call in stream.calls:
        scan = call.scan
        if scan is None or scan.name is None or scan.end is None:
            continue
        args = call.args_text or "{}"
        try:
            json.loads(args)
        except json.JSONDecodeError:
            content += text[call.raw_start : scan.end]  # arguments are not JSON: not a call
            continue
        calls.append(ParsedCall(scan.name, args))
    return content.strip() if calls else content, calls


def resolve_parser(name: str | None) -> str:
    if name is None:
        return "hermes"
    if name not in PARSER_ALIASES:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose from {sorted(PARSER_ALIASES)}.")
    return PARSER_ALIASES[name]
