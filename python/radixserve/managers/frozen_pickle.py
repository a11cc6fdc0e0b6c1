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

# Per class: its field names and one attrgetter over them (made at the first message of the class).
_FIELDS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    known = _FIELDS.get(cls)
    if known is None:
        names = tuple(f.name for f in fields(cls))
        if len(names) < 2:  # attrgetter of one name returns the value, not a tuple
            raise TypeError(f"{cls.__name__}: frozen_pickle serves dataclasses of two fields or more")
        known = _FIELDS[cls] = (names, attrgetter(*names))
    return known


def field_values(obj: Any) -> tuple[Any, ...]:  # noqa: ANN401 - any such dataclass
    """Every field of the dataclass `obj`, in field order."""
    return _fields_of(type(obj))[1](obj)


def rebuild_frozen(cls: type, values: tuple[Any, ...]) -> Any:  # noqa: ANN401 - an instance of cls
    """field_values' inverse: the fields set as the frozen dataclass's __init__ would."""
    obj = object.__new__(cls)
    for name, value in zip(_fields_of(cls)[0], values):
        object.__setattr__(obj, name, value)
    return obj
