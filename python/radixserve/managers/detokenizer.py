"""Incremental detokenization and stop-string matching (pure logic, no processes).

Decoding a request's whole output every step is quadratic in its length. `IncrementalDetokenizer`
keeps two offsets into the token list, as HF TGI and vLLM do:

    ids:   [ ... emitted long ago ... | prefix window | unread tokens ]
                              prefix_offset ^   read_offset ^

Each step decodes only `ids[prefix_offset:read_offset]` (already emitted, kept as left context so
tokenizers that strip a leading space or merge across tokens decode the boundary correctly) and
`ids[prefix_offset:]`; the new text is the difference. Text ending in U+FFFD is an incomplete
UTF-8 sequence split across tokens and is held back until the next token completes it.

When the request ends (max_new_tokens, EOS, a stop token) while a character is still incomplete,
its bytes are left out of the text rather than sent as U+FFFD, and `partial_char_dropped` says so
(the finish reason carries it to the client, docs/http_api.md). Streamed and whole outputs agree:
both are the concatenation of the same deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 sequence is at most 4 bytes and every token carries at least one byte, so a *real*
# incomplete character never stays pending for this many tokens. Past it the U+FFFD is genuine
# (the model produced invalid bytes) and holding it back would only grow the decode window.
MAX_PENDING_TOKENS = 16

DecodeFn = Callable[[Sequence[int]], str]


class TokenDecoder:
    """`decode(ids)` honouring skip_special_tokens and spaces_between_special_tokens.

    Fast tokenizers ignore `spaces_between_special_tokens`, so added tokens are joined here the
    way the slow HF tokenizers do: runs of ordinary tokens and each added token are separate
    pieces, joined with " " when the flag is set.
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._added = _added_tokens(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, (_, special) in self._added.items() if special
        }

    def __call__(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if not self.spaces_between_special_tokens or not any(i in self._added for i in ids):
            return self._decode_run(ids)
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if i not in self._added:
                run.append(i)
                continue
            if self.skip_special_tokens and i in self._special:
                continue
            if run:
                pieces.append(self._decode_run(run))
                run = []
            pieces.append(self._added[i][0])
        if run:
            pieces.append(self._decode_run(run))
        return " ".join(pieces)

    def _decode_run(self, ids: list[int]) -> str:
        # No clean-up: it rewrites " ." to "." depending on the window, which would make the
        # incremental text differ from the full decode.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )


def _added_tokens(tokenizer: Any) -> dict[int, tuple[str, bool]]:
    """id -> (content, is_special) for the tokenizer's added tokens (empty when it has none)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): (str(tok), bool(getattr(tok, "special", False))) for i, tok in decoder.items()}


class IncrementalDetokenizer:
    """Turns one request's output token stream into text deltas at O(1) decode work per token."""

    def __init__(self, decode: DecodeFn) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything emitted so far
        self.partial_char_dropped = False  # the final text left out an incomplete character

    def append(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens and return the newly stable text (possibly empty).

        `final` releases held-back text: no later token can complete it, so a trailing incomplete
        character is dropped (and `partial_char_dropped` set) instead of sent as U+FFFD.
        """
        self.ids.extend(new_ids)
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        pending = len(self.ids) - self.read_offset
        incomplete = new_text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. a token that only starts a multi-byte character
        if incomplete and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        if incomplete:  # final here: the bytes of an unfinished character, never to be finished
            kept = delta.rstrip(REPLACEMENT_CHAR)
            self.partial_char_dropped = len(kept) < len(delta)
            delta = kept
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Keeps stop strings out of the streamed text; the scheduler decides which one ended it.

    The longest suffix of the text that is a proper prefix of some stop string is withheld until
    later text resolves it, so a stream never shows part of a stop string. When the scheduler
    reports that the newest token completed a stop string, `cut` ends the text at that occurrence.
    A complete stop string the scheduler did not report (before min_new_tokens) is plain text.
    """

    def __init__(self, stop: Sequence[str] | None, no_stop_trim: bool = False) -> None:
        self.stops = sorted({s for s in (stop or ()) if s}, key=len, reverse=True)
        self.no_stop_trim = no_stop_trim
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str, final: bool = False) -> str:
        """Add text; return what may be emitted now (all of it once `final`)."""
        buf = self.pending + text
        keep = 0 if final else self._held_suffix_len(buf)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def cut(self, head: str, newest: str, stop: str) -> str:
        """The final text: `head` then `newest` (the newest token's text), cut at the first
        occurrence of the reported `stop` that ends in `newest`."""
        buf = self.pending + head + newest
        self.pending = ""
        pos = buf.find(stop, max(len(buf) - len(newest) - len(stop) + 1, 0))
        if pos < 0:  # the scheduler's decode holds it but this text does not (skipped specials)
            return buf
        self.matched = stop
        return buf[: pos + len(stop)] if self.no_stop_trim else buf[:pos]

    def _held_suffix_len(self, buf: str) -> int:
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class DecodeState:
    """Everything the detokenizer keeps for one request: the text stream and its stop strings."""

    def __init__(self, decode: DecodeFn, stop: Sequence[str] | None, no_stop_trim: bool) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.matcher = StopStringMatcher(stop, no_stop_trim)

    @property
    def matched_stop(self) -> str | None:
        return self.matcher.matched

    @property
    def partial_char_dropped(self) -> bool:
        """The output ended inside a multi-byte character, whose bytes the text leaves out (a stop
        string that ended the text earlier makes it moot)."""
        return self.detok.partial_char_dropped and self.matcher.matched is None

    def step(self, new_ids: Sequence[int], finished: bool, matched_stop: str | None = None) -> str:
        """Feed one step's tokens; return the text to stream. `finished` flushes held text;
        `matched_stop` is the stop string the scheduler found completed by the last of them."""
        if matched_stop is None:
            return self.matcher.feed(self.detok.append(new_ids, final=finished), final=finished)
        head = self.detok.append(new_ids[:-1])
        return self.matcher.cut(head, self.detok.append(new_ids[-1:], final=True), matched_stop)
