"""User-facing sampling parameters (SGLang field names and defaults).

`from_dict` is the single entry point from untrusted JSON: it rejects unknown keys and wrong types
with ValueError so the HTTP layer can answer 400. `normalize()` then `verify(vocab_size)` run once
per request before it reaches the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

# Below this temperature sampling is indistinguishable from argmax; dividing by it would overflow.
GREEDY_EPS = 1e-6

# top_k value meaning "no top-k cut". Kept independent of the vocab size so params can be
# normalized before the model is known; the sampler treats any top_k >= vocab as "keep all".
TOP_K_ALL = 1 << 30

_PENALTY_RANGE = 2.0
# Below this a seen token's logit is scaled more than 100x, which only makes the output degenerate;
# near 1e-30 it overflows float32 into inf/NaN logits (docs/http_api.md, sampling parameters).
MIN_REPETITION_PENALTY = 0.01

# Largest temperature accepted (see verify).
TEMPERATURE_MAX = 1e4

# The sampler keeps seeds in an int64 tensor and uses -1 for "unseeded", so it tells apart exactly
# the seeds in [0, SEED_MAX]; anything else would alias one of them (it used to be folded mod 2**63).
SEED_MAX = (1 << 63) - 1

# OpenAI's range for logit_bias values: -100 bans a token, +100 all but forces it.
LOGIT_BIAS_MAX = 100.0

# A stop_regex is searched in the text of the newest this-many output tokens after each token
# (the decode is per token and request, so the window bounds its cost); a match must fit in it.
STOP_REGEX_TAIL_TOKENS = 128

# Accepted JSON types per field. bool is excluded from numbers explicitly (isinstance(True, int)).
_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_OPT_STR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocab
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] | None = None
    stop_regex: list[str] | None = None  # SGLang's: Python regular expressions (re.search)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # xgrammar's structural tag as JSON: SGLang's {"structures": [{"begin", "schema", "end"}],
    # "triggers": [...]} or xgrammar's {"type": "structural_tag", "format": {...}}.
    structural_tag: str | None = None
    # Token id (as a string, as in JSON and OpenAI) -> value added to that token's logit.
    logit_bias: dict[str, float] | None = None
    # Handed to the request's custom logit processor (SGLang's field; custom_logit_processor.py).
    custom_params: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a JSON object; unknown keys / wrong types raise ValueError.

        A JSON null for a field with a non-None default means "use the default", because OpenAI-style
        clients routinely send explicit nulls for unset options.
        """
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if value is None:
                continue  # default (None for the optional fields, the SGLang default otherwise)
            kwargs[key] = _check_type(key, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ normalize / verify
    def normalize(self) -> None:
        """Canonicalize in place; idempotent."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if self.temperature < GREEDY_EPS:
            # Greedy is expressed as top_k = 1 so the sampler has a single greedy test; temperature
            # 1.0 keeps any later division harmless.
            self.top_k = 1
            self.temperature = 1.0
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError describing the first invalid value. This is the authoritative check
        (the HTTP layer may refuse earlier); the accepted ranges are:

        - every float is finite (NaN and +-Infinity, which JSON parsers accept, are refused);
        - temperature in [0, TEMPERATURE_MAX] (0 = greedy; beyond ~100 sampling is already uniform
          over the kept tokens, the cap keeps the value far inside float32);
        - top_p in (0, 1]; min_p in [0, 1]; top_k -1 (off) or >= 1;
        - frequency_penalty and presence_penalty in [-2, 2];
          repetition_penalty in [MIN_REPETITION_PENALTY, 2];
        - max_new_tokens >= 0; min_new_tokens in [0, max_new_tokens]; n >= 1;
        - stop_token_ids in [0, vocab_size); at most one of json_schema, regex, ebnf, structural_tag;
        - seed in [0, SEED_MAX] (GenerateReqInput.expand checks that seed + n - 1 fits too);
        - logit_bias keys are token ids in [0, vocab_size), values in [-100, 100];
        - every stop_regex compiles (Python `re`) and does not match the empty string.

        Values inside these ranges can still be numerically extreme: the sampler keeps them finite
        and finishes a request whose logits still end up non-finite with an error instead of
        sampling from them.
        """
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}.")
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be in [0, {TEMPERATURE_MAX:g}], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -_PENALTY_RANGE <= value <= _PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], got {self.repetition_penalty}."
            )
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be at least 0, got {self.min_new_tokens}.")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        self._verify_seed()
        grammars = [g for g in _OPT_STR_FIELDS if getattr(self, g) is not None]
        if len(grammars) > 1:
            raise ValueError(
                f"Only one of {', '.join(_OPT_STR_FIELDS)} can be set, got {', '.join(grammars)}."
            )
        for tok in self.stop_token_ids or ():
            if not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {tok}.")
        self._verify_logit_bias(vocab_size)
        self._verify_stop_regex()

    def _verify_stop_regex(self) -> None:
        for pattern in self.stop_regex or ():
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"Invalid stop_regex {pattern!r}: {exc}.") from None
            if compiled.fullmatch("") is not None:
                raise ValueError(f"stop_regex {pattern!r} matches the empty string: it would stop at once.")

    def _verify_logit_bias(self, vocab_size: int) -> None:
        for key, value in (self.logit_bias or {}).items():
            if not 0 <= int(key) < vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key}.")
            if not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}.")

    def _verify_seed(self) -> None:
        if self.seed is not None:
            check_seed(self.seed, 1)


def check_seed(seed: int, n: int) -> None:
    """ValueError unless `seed` and the seeds of its n samples (seed + j) are all in [0, SEED_MAX]."""
    top = SEED_MAX - (n - 1)
    if not 0 <= seed <= top:
        samples = f" (n={n}: sample j uses seed + j)" if n > 1 else ""
        raise ValueError(f"seed must be in [0, {top}]{samples}, got {seed}.")


def _check_type(key: str, value: Any) -> Any:
    """Validate one JSON value against the field's type; return it converted (int -> float)."""
    if key in _INT_FIELDS or key == "seed":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {type(value).__name__}")
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {type(value).__name__}")
        return float(value)
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a boolean, got {type(value).__name__}")
        return value
    if key in _OPT_STR_FIELDS:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {type(value).__name__}")
        return value
    if key in ("stop", "stop_regex"):
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise ValueError(f"{key} must be a string or a list of strings")
    if key == "stop_token_ids":
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        raise ValueError("stop_token_ids must be a list of integers")
    if key == "logit_bias":
        return _check_logit_bias(value)
    if key == "custom_params":
        if not isinstance(value, dict):
            raise ValueError(f"custom_params must be an object, got {type(value).__name__}")
        return value
    raise AssertionError(f"unhandled sampling field {key}")  # every dataclass field is listed above


def _check_logit_bias(value: Any) -> dict[str, float]:
    """{token id: bias}: keys are decimal token ids (strings, as JSON object keys must be; ints
    are accepted from Python callers), values finite numbers."""
    if not isinstance(value, dict):
        raise ValueError(
            f"logit_bias must be an object mapping token ids to numbers, got {type(value).__name__}"
        )
    out: dict[str, float] = {}
    for key, bias in value.items():
        token = str(key).strip()
        if isinstance(key, bool) or not token.lstrip("-").isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {key}")
        out[str(int(token))] = float(bias)
    return out
