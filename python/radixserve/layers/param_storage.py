"""Swapping a parameter's storage, meta device included (a weight held only in quantized form)."""

from __future__ import annotations

import torch
from torch import nn


def replace_storage(param: nn.Parameter, data: torch.Tensor) -> None:
    """Give `param` new contents, the same Python object (callers hold it: the loader's parameter
    dicts). `param.data = ...` cannot move a parameter to or from the meta device."""
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
