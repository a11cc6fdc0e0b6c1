"""`--reasoning-parser`: separate a model's `<think>...</think>` reasoning from its answer.

- `qwen3`: the model opens `<think>` itself (or answers directly without one).
- `deepseek-r1`: the chat template already opened `<think>`, so the output starts inside the
  reasoning and only `</think>` appears (a leading `<think>` is tolerated too).

`ReasoningStream.feed(text)` takes the whole text so far and returns the new (reasoning, content)
pieces; a tag split across steps is held back until it is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.openai.tool_calls import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass
class ReasoningStream:
    starts_in_reasoning: bool
    cursor: int = 0
    mode: str = "start"  # start | reasoning | content
    after_reasoning: bool = False  # content follows a </think>: skip its leading whitespace

    @classmethod
    def for_parser(cls, name: str) -> ReasoningStream:
        if name not in REASONING_PARSERS:
            raise ValueError(f"Unknown reasoning parser {name!r}; choose from {REASONING_PARSERS}.")
        return cls(starts_in_reasoning=name == "deepseek-r1")

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        if self.mode == "start" and not self._start(text, final):
            return "", ""
        if self.mode == "reasoning":
            self._reasoning(text, final, reasoning)
        if self.mode == "content":
            piece = text[self.cursor :]
            if self.after_reasoning:  # the blank line after </think> is not content
                stripped = piece.lstrip()
                if not stripped and not final:
                    return "".join(reasoning), ""
                self.cursor += len(piece) - len(stripped)
                piece, self.after_reasoning = stripped, False
            content.append(piece)
            self.cursor = len(text)
        return "".join(reasoning), "".join(content)

    def _start(self, text: str, final: bool) -> bool:
        """Decide whether the output opens with reasoning; False while that is still unknown."""
        head = text[self.cursor :]
        stripped = head.lstrip()
        if stripped.startswith(THINK_START):
            self.cursor += len(head) - len(stripped) + len(THINK_START)
            self.mode = "reasoning"
            return True
        if not final and THINK_START.startswith(stripped):
            return False  # empty so far, or a partial "<think"
        self.mode = "reasoning" if self.starts_in_reasoning else "content"
        return True

    def _reasoning(self, text: str, final: bool, out: list[str]) -> None:
        rest = text[self.cursor :]
        idx = rest.find(THINK_END)
        if idx < 0:
            keep = 0 if final else partial_suffix(rest, THINK_END)
            out.append(rest[: len(rest) - keep])
            self.cursor += len(rest) - keep
            return
        out.append(rest[:idx])
        self.cursor += idx + len(THINK_END)
        self.mode = "content"
        self.after_reasoning = True


def reasoning_token_count(text: str, output_ids: list[int], parser: str, tokenizer: Any) -> int:  # noqa: ANN401
    """Output tokens spent reasoning (OpenAI's usage reasoning_tokens): every token through the
    one that closes the reasoning where THINK_END is a single token (Qwen3's and DeepSeek-R1's
    tokenizers), all of them when the output stopped inside its reasoning; elsewhere the
    reasoning re-tokenized with its tags (an estimate: a re-tokenization need not be the tokens
    that were generated)."""
    reasoning, content = split_reasoning(text, parser)
    if reasoning is None:
        return 0
    end = tokenizer.encode(THINK_END, add_special_tokens=False)
    if len(end) == 1 and end[0] in output_ids:
        return output_ids.index(end[0]) + 1
    if THINK_END not in text:  # stopped (length, abort) while still reasoning
        return len(output_ids)
    estimate = tokenizer.encode(f"{THINK_START}{reasoning}{THINK_END}", add_special_tokens=False)
    return min(len(estimate), len(output_ids))


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """Whole-text split: (reasoning or None when there was none, content)."""
    stream = ReasoningStream.for_parser(parser)
    reasoning, content = stream.feed(text, final=True)
    return (reasoning.strip() or None), content
