"""Grammar compilation for constrained decoding, on xgrammar (seed INVENTORY §25).

A request's grammar is identified by a key `(kind, spec)`: `("json", schema)`, `("regex", r)` or
`("ebnf", g)` or `("structural_tag", t)`, checked in that order. `GrammarBackend.get_cached_or_future_value(key)` returns a
Future of the compiled grammar: compilation runs on a small thread pool so the scheduler thread
never blocks on it, and the Future is cached by key so the same schema compiles once. A spec that
fails to compile resolves to `InvalidGrammar(message)` instead of raising, so a bad request is
answered with the compiler's reason and never crashes the scheduler.

Each request then gets its own `GrammarMatcher` (the per-request parse state) from the compiled
grammar; n > 1 siblings share the compiled grammar but never a matcher.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixserve.constrained.grammar_limits import nesting_error
from radixserve.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, spec), kind in GRAMMAR_KINDS

GRAMMAR_KINDS = ("json", "regex", "ebnf", "structural_tag")

# SGLang's json_schema value meaning "any JSON value" (xgrammar's built-in JSON grammar).
ANY_JSON = "$$ANY$$"

# The compile cache is an LRU bounded both in entries and in the compiled grammars' own size
# (xgrammar's memory_size_bytes): ~80 KB for a small JSON schema on a 49k vocabulary, MBs for big
# ones, so a count alone let a stream of distinct large schemas hold GBs.
DEFAULT_CACHE_SIZE = 1024
DEFAULT_CACHE_BYTES = 64 << 20

# What a cached compile failure counts for (its message only).
_INVALID_ENTRY_BYTES = 1024

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need only the reason.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class InvalidGrammar:
    """A grammar that failed to compile; `message` is the compiler's reason."""

    message: str


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """The cache key of a request's grammar, or None for an unconstrained request."""
    if params.json_schema is not None:
        return ("json", params.json_schema)
    if params.regex is not None:
        return ("regex", params.regex)
    if params.ebnf is not None:
        return ("ebnf", params.ebnf)
    if params.structural_tag is not None:
        return ("structural_tag", params.structural_tag)
    return None


def structural_tag_args(xgr: Any, spec: str) -> tuple[Any, ...]:  # noqa: ANN401 - the xgrammar module
    """The arguments of xgrammar's from_structural_tag / compile_structural_tag for `spec`:
    SGLang's form ({"structures": [{"begin", "schema", "end"}], "triggers"}) becomes xgrammar's
    tag items and triggers; any other object is xgrammar's own structural-tag JSON."""
    tag = json.loads(spec)
    if not isinstance(tag, dict):
        raise ValueError(f"a structural tag is a JSON object, got {type(tag).__name__}")
    if "structures" not in tag:
        return (spec,)
    items = []
    for s in tag["structures"]:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
            raise ValueError("each of structures needs 'begin', 'schema' and 'end'")
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]))
    return (items, tag.get("triggers") or [])


def clean_compiler_error(exc: BaseException) -> str:
    """xgrammar's exception text without its log-line prefix and trailing blank lines."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text) or type(exc).__name__


# One JSON string character for length-bounded strings: printable ASCII except quote and backslash.
_SAFE_CHARS = r"[ !#-\[\]-~]"
# Keys whose values are data, not subschemas: never rewritten.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})


def fix_string_lengths(node: Any) -> Any:  # noqa: ANN401 - any JSON value
    """A copy of a JSON schema where strings with minLength/maxLength use an equivalent pattern.

    xgrammar (0.2.x) compiles a length-bounded string to a byte-level character class that admits
    raw control characters (invalid JSON) and malformed UTF-8 (surrogates, overlong forms), whose
    replacement characters then break the length bound. `_SAFE_CHARS` keeps the bounds exact over
    printable ASCII without quote or backslash: always valid, one byte per character. Unbounded
    strings keep xgrammar's rule (any character).
    """
    if isinstance(node, list):
        return [fix_string_lengths(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else fix_string_lengths(v)) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not ({"pattern", "format", "enum", "const"} & set(out)):
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{_SAFE_CHARS}{{{low},{'' if high is None else int(high)}}}$"
    return out


def import_xgrammar() -> Any:  # noqa: ANN401 - the xgrammar module
    try:
        import xgrammar
    except ImportError as exc:  # an optional dependency: say how to get it
        raise RuntimeError(
            "Constrained decoding (json_schema / regex / ebnf) needs the 'xgrammar' package: "
            "pip install xgrammar"
        ) from exc
    return xgrammar


class GrammarBackend:
    """Compiles grammars for one tokenizer; thread-safe, with a compile cache keyed by GrammarKey.

    any_whitespace=False makes JSON compact (", " and ": " separators, no free whitespace): small
    models otherwise tend to emit whitespace forever, and the output is still valid JSON.
    """

    def __init__(
        self,
        tokenizer: Any,  # noqa: ANN401 - an HF tokenizer
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        *,
        max_workers: int = 2,
        any_whitespace: bool = False,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # xgrammar's own cache is off: ours keys by the request's spec and also caches failures.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_workers, cache_enabled=False)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._sizes: dict[GrammarKey, int] = {}  # compiled entries only
        self.cached_bytes = 0
        # Reentrant: a future that is already done runs its done-callback in the adding thread.
        self._lock = threading.RLock()
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="radixserve-grammar")

    # ------------------------------------------------------------------ compilation
    def get_cached_or_future_value(self, key: GrammarKey) -> tuple[Future[Any], bool]:
        """(Future of CompiledGrammar | InvalidGrammar, cache_hit). Starts compiling on a miss."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future, True
            future = self._executor.submit(self._compile_or_invalid, key)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda done: self._account(key, done))
        return future, False

    def _account(self, key: GrammarKey, future: Future[Any]) -> None:
        """Count a finished compilation's size (while it is still the cached entry for key)."""
        if future.cancelled():
            return
        value = future.result()
        size = int(getattr(value, "memory_size_bytes", 0)) or _INVALID_ENTRY_BYTES
        with self._lock:
            if self._cache.get(key) is future and key not in self._sizes:
                self._sizes[key] = size
                self.cached_bytes += size
                self._evict()

    def _evict(self) -> None:
        """Drop least recently used entries beyond the limits (lock held). Requests already
        holding an evicted grammar keep it; the next request for that key compiles again."""
        while len(self._cache) > self.cache_size or (
            self.cached_bytes > self.cache_bytes and len(self._cache) > 1
        ):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def cache_stats(self) -> tuple[int, int]:
        """(entries, bytes of the compiled ones)."""
        with self._lock:
            return len(self._cache), self.cached_bytes

    def _compile_or_invalid(self, key: GrammarKey) -> Any:  # noqa: ANN401 - CompiledGrammar | InvalidGrammar
        # Also here, not only in the TokenizerManager: whatever reaches the scheduler must not
        # recurse out of the stack or hold a compile thread for minutes.
        too_deep = nesting_error(*key)
        if too_deep is not None:
            return InvalidGrammar(too_deep)
        try:
            return self.compile(key)
        except Exception as exc:  # any compiler failure is the request's problem, not the server's
            message = f"Invalid {key[0]} grammar: {clean_compiler_error(exc)}"
            logger.info("%s", message)
            return InvalidGrammar(message)

    def compile(self, key: GrammarKey) -> Any:  # noqa: ANN401 - xgrammar.CompiledGrammar
        """Compile one grammar (blocking; raises on an invalid spec). Runs on the pool."""
        kind, spec = key
        if kind == "json":
            if spec == ANY_JSON:
                return self.compiler.compile_builtin_json_grammar()
            schema = fix_string_lengths(json.loads(spec))
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=self.any_whitespace)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "ebnf":
            return self.compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(*structural_tag_args(self._xgr, spec))
        raise ValueError(f"Unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")

    # ------------------------------------------------------------------ matching
    def new_matcher(self, compiled: Any) -> Any:  # noqa: ANN401 - xgrammar types
        """A fresh per-request matcher (its parse state starts at the grammar's root)."""
        return self._xgr.GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
