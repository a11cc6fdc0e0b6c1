"""How a ServerArgs field is declared: its default, its --help text and argparse's extras
(choices, nargs, aliases). A module of its own so that the flag groups kept beside their checks
(hicache_args, spec_args, disagg_args) declare their fields without importing server_args."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def arg_field(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse's name
    return field(default=default, metadata={"help": help, **kw})
