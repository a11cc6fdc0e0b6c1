"""Small host-side tensor helpers for the per-step path of a CPU server.

A decode step's host work (the scheduler's bookkeeping, the batch's input tensors, the sampler's
call, result processing) runs right after the forward has streamed the model's weights through
the caches, so its code and data are cold: a small torch call then costs many times its warm
cost (benchmark/bench_cold_ops.py), and at one request such work came to ~1.3-1.8 ms of a ~8-9 ms
step on the built-in model (benchmark/bench_step_host.py; docs/cpu_backend.md, "Host work around
a step"). These helpers do the common cases with fewer torch calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import numpy as np
import torch

P = ParamSpec("P")
R = TypeVar("R")


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`, built by numpy: torch.from_numpy(np.array(list)) costs about
    half of torch.tensor(list), and less than one arithmetic op on an existing tensor."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    """@torch.inference_mode() for a method called once or more each step: enters the mode only
    when the caller has not (torch's decorator makes and enters a new context object every call)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper
