"""Pickling a frozen slots dataclass as (class, field values).

A frozen slots dataclass's own pickling builds a state by looking each field up by name, and
restores it the same way, on both sides of every message. The scheduler's per-step message
(io_struct.StepOutputs) is pickled once a decode step, right after a forward, when the caches are
cold (docs/cpu_backend.md, "Host work around a step"): one attrgetter over the field names, and
object.__setattr__ on the way back, do the same with less work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import Any

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_FIELD_GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def _getter(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    getter = _FIELD_GETTERS.get(cls)
    if getter is None:
        names = tuple(f.name for f in fields(cls))
        if len(names) < 2:  # attrgetter of one name returns the value, not a tuple
            raise TypeError(f"{cls.__name__}: frozen_pickle serves dataclasses of two fields or more")
        _FIELD_NAMES[cls], getter = names, attrgetter(*names)
        _FIELD_GETTERS[cls] = getter
    return getter


def field_values(obj: Any) -> tuple[Any, ...]:  # noqa: ANN401 - any such dataclass
    """Every field of the dataclass `obj`, in field order."""
    return _getter(type(obj))(obj)


def rebuild_frozen(cls: type, values: tuple[Any, ...]) -> Any:  # noqa: ANN401 - an instance of cls
    """field_values' inverse: the fields set as the frozen dataclass's __init__ would."""
    _getter(cls)
    obj = object.__new__(cls)
    for name, value in zip(_FIELD_NAMES[cls], values):
        object.__setattr__(obj, name, value)
    return obj
