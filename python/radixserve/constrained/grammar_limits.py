"""Nesting limits on a request's grammar, checked before anything parses it.

A json_schema 1,000 levels deep made the validator's recursion (and json.loads) raise
RecursionError, and xgrammar's schema conversion grows faster than cubically with depth (about
0.1 s at 64 levels of nested objects, 1.2 s at 128, 50 s at 500), so depth is refused up front,
in linear time and without recursion. docs/structured_outputs.md ("Limits") states the limits.

- json_schema: at most MAX_JSON_SCHEMA_DEPTH levels of JSON nesting (objects and arrays) in the
  schema document; a nested object property costs two (its schema and the "properties" map), so
  this is about 64 levels of nested objects.
- regex / ebnf: at most MAX_GROUP_DEPTH levels of nested parentheses (outside string literals,
  character classes and, in EBNF, comments). xgrammar itself stops near 1,000 with a less helpful
  message; no hand-written grammar comes near 64.
"""

from __future__ import annotations

import re

MAX_JSON_SCHEMA_DEPTH = 128
MAX_GROUP_DEPTH = 64

# Tokens that matter for nesting; strings, escapes, classes and comments are matched whole so
# that the brackets inside them are skipped.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_REGEX_TOKENS = re.compile(r"\\.|\[\^?\]?(?:\\.|[^\]\\])*\]|[()]", re.DOTALL)
_EBNF_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[()]', re.DOTALL)

_OPENERS = frozenset("([{")
_CLOSERS = frozenset(")]}")


def nesting_depth(text: str, tokens: re.Pattern[str], stop_above: int | None = None) -> int:
    """The deepest bracket nesting of `text` (unbalanced brackets are the parser's business);
    stops counting as soon as the depth passes `stop_above`."""
    depth = deepest = 0
    for match in tokens.finditer(text):
        token = match.group()
        if token in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        elif token in _CLOSERS:
            depth -= 1
    return deepest


def nesting_error(kind: str, spec: str) -> str | None:
    """Why a grammar of `kind` (one of GRAMMAR_KINDS) is nested too deep, or None."""
    field, tokens, limit, what = _RULES[kind]
    if nesting_depth(spec, tokens, stop_above=limit) <= limit:
        return None
    return f"Invalid {field}: nested deeper than the limit of {limit} levels ({what})."


# kind -> (the request field, its tokens, the limit, what is counted)
_RULES = {
    "json": ("json_schema", _JSON_TOKENS, MAX_JSON_SCHEMA_DEPTH, "objects and arrays"),
    "regex": ("regex", _REGEX_TOKENS, MAX_GROUP_DEPTH, "parentheses"),
    "ebnf": ("ebnf", _EBNF_TOKENS, MAX_GROUP_DEPTH, "parentheses"),
    "structural_tag": ("structural_tag", _JSON_TOKENS, MAX_JSON_SCHEMA_DEPTH, "objects and arrays"),
}
