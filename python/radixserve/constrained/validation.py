"""Cheap up-front validation of a request's grammar, in the TokenizerManager: a bad json_schema /
regex / ebnf / structural_tag is answered with HTTP 400 and the compiler's reason before the request is queued.

Only the tokenizer-independent part of compilation runs here (xgrammar parses the spec into its
grammar IR, which is where syntax and unsupported-feature errors come from); the scheduler still
compiles against the vocabulary and turns any remaining failure into an abort with the message.
"""

from __future__ import annotations

import functools
import json
import threading

from radixserve.constrained.grammar_backend import (
    ANY_JSON,
    GrammarKey,
    clean_compiler_error,
    grammar_key,
    import_xgrammar,
    structural_tag_args,
)
from radixserve.constrained.grammar_limits import nesting_error
from radixserve.sampling.sampling_params import SamplingParams


def validate_grammar(params: SamplingParams) -> None:
    """Raise ValueError (-> HTTP 400) when the request's grammar cannot be compiled."""
    key = grammar_key(params)
    if key is None:
        return
    error = _grammar_error(key)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=1024)
def _grammar_error(key: GrammarKey) -> str | None:
    kind, spec = key
    too_deep = nesting_error(kind, spec)
    if too_deep is not None:  # before anything parses it: json.loads and the walks below recurse
        return too_deep
    if kind == "json":
        if spec == ANY_JSON:
            return None
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            return f"Invalid json_schema: not valid JSON ({exc})."
        if not isinstance(schema, (dict, bool)):
            return f"Invalid json_schema: a schema is a JSON object or boolean, got {type(schema).__name__}."
        ref = _non_local_ref(schema)
        if ref is not None:  # xgrammar only warns and leaves that part unconstrained
            return f"Invalid json_schema: only local $ref ('#' or '#/...') is supported, got {ref!r}."
    try:
        xgr = import_xgrammar()
    except RuntimeError as exc:
        return str(exc)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(*structural_tag_args(xgr, spec))
        else:
            xgr.Grammar.from_ebnf(spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
        return f"Invalid {kind} grammar: {clean_compiler_error(exc)}"
    return None


def _non_local_ref(node: object) -> str | None:
    """The first `$ref` that does not point inside the schema itself (a URL, a file), if any."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return ref
        # enum / const / default / examples hold data, where "$ref" is just a key
        children = [v for k, v in node.items() if k not in ("enum", "const", "default", "examples")]
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        ref = _non_local_ref(child)
        if ref is not None:
            return ref
    return None


def prewarm() -> None:
    """Import xgrammar on a background thread so the first constrained request does not stall the
    event loop for the seconds the import takes (a no-op when xgrammar is not installed)."""

    def load() -> None:
        try:
            import_xgrammar()
        except RuntimeError:
            pass

    threading.Thread(target=load, name="radixserve-xgrammar-import", daemon=True).start()
