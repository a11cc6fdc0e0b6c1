"""Custom logit processors (SGLang's `custom_logit_processor`, with --enable-custom-logit-processor),
loaded without executing a pickle.

SGLang's client sends `CustomLogitProcessor.to_str()`: `{"callable": "<hex of dill.dumps(cls)>"}`,
which SGLang's server unpickles with dill, so a client can run any code on the server. Here the
pickle's opcodes are read (pickletools) and never executed: the only pickle accepted is a single
reference to a class (`module` + `name`, the form pickle and dill write for a class that can be
imported), and that class is taken only from radixserve's built-in processors (SGLang's module
name maps onto them) or from a module the operator listed in --custom-logit-processor-modules. A
class defined in a client's `__main__` (which dill pickles by value, as code) is refused.

A processor is called, as in SGLang, with the logits rows of the requests using it ([k, vocab],
after penalties and the grammar mask, before temperature and top-k/top-p) and each request's
`sampling_params.custom_params` with `"__req__"` (the scheduler's request: its origin_input_ids
and output_ids) added; it returns the rows.
"""

from __future__ import annotations

import functools
import importlib
import json
import pickle
import pickletools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

# SGLang's module of built-in processors: a client that pickles one of them by reference gets
# radixserve's class of the same name.
SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"
# Opcodes a single class reference is made of (protocols 0-5); anything else (a call, a build, an
# object) is refused before a byte of it runs.
_AFTER_REFERENCE = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "STOP"})  # memo bookkeeping
_REFERENCE_OPCODES = _AFTER_REFERENCE | {
    "PROTO",
    "FRAME",
    "GLOBAL",
    "STACK_GLOBAL",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "UNICODE",
}


class CustomLogitProcessor(ABC):
    """Base of every processor a request may name (SGLang's interface)."""

    @abstractmethod
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        """logits [k, vocab] of the requests using this processor; returns them (in place is fine)."""

    @classmethod
    def to_str(cls) -> str:
        """SGLang's wire form: the class pickled by reference (what SGLang's dill.loads reads too)."""
        return json.dumps({"callable": pickle.dumps(cls).hex()})


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """SGLang's: `custom_params: {"token_ids": [...]}` can never be sampled."""

    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            banned = (params or {}).get("token_ids") or []
            if banned:
                logits[row, banned] = -float("inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """SGLang's: `custom_params: {"thinking_budget": N}` ends the reasoning after N tokens (a new
    line, then the end-of-thinking token). Subclasses name the model's token ids."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            budget = (params or {}).get("thinking_budget")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            forced = self._forced_token(params["__req__"], budget)
            if forced is not None:
                logits[row, :] = -float("inf")
                logits[row, forced] = 0.0
        return logits

    def _forced_token(self, req: Any, budget: int) -> int | None:  # noqa: ANN401 - the scheduler's Req
        ids = [*req.origin_input_ids, *req.output_ids]
        if self.THINKING_START_TOKEN_ID not in ids or self.THINKING_END_TOKEN_ID in ids:
            return None  # not thinking
        if len(ids) - ids.index(self.THINKING_START_TOKEN_ID) - 1 < budget:
            return None
        if not req.output_ids or req.output_ids[-1] != self.NEW_LINE_TOKEN_ID:
            return self.NEW_LINE_TOKEN_ID
        return self.THINKING_END_TOKEN_ID


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 128798
    THINKING_END_TOKEN_ID = 128799
    NEW_LINE_TOKEN_ID = 201


BUILTIN: dict[str, type[CustomLogitProcessor]] = {
    cls.__name__: cls
    for cls in (
        DisallowedTokensLogitsProcessor,
        Qwen3ThinkingBudgetLogitProcessor,
        DeepSeekR1ThinkingBudgetLogitProcessor,
    )
}


def pickled_reference(data: bytes) -> tuple[str, str]:
    """(module, name) of a pickle that is one class reference; ValueError for anything else. The
    opcodes are only read."""
    strings: list[str] = []
    found: tuple[str, str] | None = None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name not in _REFERENCE_OPCODES or (found is not None and op.name not in _AFTER_REFERENCE):
                raise ValueError(f"the pickle does more than name a class (opcode {op.name})")
            if op.name == "GLOBAL":
                found = tuple(str(arg).split(" ", 1))  # type: ignore[assignment]
            elif op.name == "STACK_GLOBAL":
                if len(strings) < 2:
                    raise ValueError("a class reference without its module and name")
                found = (strings[-2], strings[-1])
            elif isinstance(arg, str) and op.name.endswith("UNICODE"):
                strings.append(arg)
    except ValueError as exc:  # pickletools' own for malformed data, and the refusals above
        raise ValueError(f"not a class reference: {exc}") from None
    if found is None:
        raise ValueError("the pickle names no class")
    return found


@functools.lru_cache(maxsize=256)
def load_processor(spec: str, allowed_modules: tuple[str, ...]) -> CustomLogitProcessor:
    """The processor instance `spec` (SGLang's to_str() JSON) names; ValueError (a 400) when it is
    malformed, not a plain class reference, or names a class this server does not allow."""
    try:
        data = bytes.fromhex(json.loads(spec)["callable"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f'expected {{"callable": "<hex pickle>"}} ({exc})') from None
    module, name = pickled_reference(data)
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not a top-level class name")
    if module == SGLANG_MODULE or module == __name__:
        cls = BUILTIN.get(name)
    elif module in allowed_modules:
        cls = getattr(importlib.import_module(module), name, None)
    else:
        raise ValueError(
            f"{module}.{name} is not allowed: the built-in processors and the modules listed in "
            "--custom-logit-processor-modules are"
        )
    if not (isinstance(cls, type) and issubclass(cls, CustomLogitProcessor)):
        raise ValueError(f"{module}.{name} is not a CustomLogitProcessor")
    try:
        return cls()
    except TypeError as exc:  # an abstract class
        raise ValueError(f"{module}.{name} cannot be used: {exc}") from None


def processor_for(spec: str, args: ServerArgs) -> tuple[CustomLogitProcessor | None, str | None]:
    """A request's processor (the TokenizerManager checks it first; the scheduler again, for
    in-process callers), or None and why it cannot have one."""
    if not args.enable_custom_logit_processor or args.speculative_algorithm is not None:
        return (
            None,
            "custom_logit_processor needs --enable-custom-logit-processor and no speculative decoding.",
        )
    try:
        return load_processor(spec, tuple(args.custom_logit_processor_modules)), None
    except ValueError as exc:
        return None, f"Invalid custom_logit_processor: {exc}"
