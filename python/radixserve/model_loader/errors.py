"""Errors raised while locating, validating and loading model files.

Every failure a user can cause by pointing radixserve at the wrong folder ends up as a
`ModelLoadError` whose message names the path and says what to do, instead of a stack trace from
deep inside transformers or safetensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ModelLoadError(Exception):
    """A model folder, its config or its weights cannot be used."""


def check_shape(name: str, expected: Sequence[int], got: Sequence[int]) -> None:
    """Raise if checkpoint tensor `name` (shape `got`) does not have the shape the config implies,
    so that a config/weights mismatch (a config.json of another model size) fails with the
    tensor's name instead of a bare copy_() size error, or going unnoticed where a rank reads
    only its slice of the tensor."""
    expected_t, got_t = tuple(int(d) for d in expected), tuple(int(d) for d in got)
    if expected_t != got_t:
        raise ModelLoadError(
            f"Shape mismatch for {name}: the config implies {expected_t}, the checkpoint has {got_t}. "
            "The config.json and the weight files probably belong to different models (or to "
            "different sizes of one model)."
        )


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` (`src`) into `dst`, in dst's dtype, once their shapes agree."""
    check_shape(name, dst.shape, src.shape)
    dst.copy_(src.to(dst.dtype))


def unsupported_architecture_error(
    architecture: str | None, supported: Sequence[str], path: str
) -> ModelLoadError:
    """The error for a config.json whose `architectures` names a model we do not implement."""
    shown = architecture if architecture else "<none: config.json has no 'architectures' entry>"
    return ModelLoadError(
        f"Unsupported model architecture {shown} in {path}/config.json. "
        f"radixserve supports: {', '.join(supported)}."
    )
