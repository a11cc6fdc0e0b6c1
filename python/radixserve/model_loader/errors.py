"""Errors raised while locating, validating and loading model files.

Every failure a user can cause by pointing radixserve at the wrong folder ends up as a
`ModelLoadError` whose message names the path and says what to do, instead of a stack trace from
deep inside transformers or safetensors.
"""

from __future__ import annotations

from collections.abc import Sequence


class ModelLoadError(Exception):
    """A model folder, its config or its weights cannot be used."""


def check_shape(name: str, expected: Sequence[int], got: Sequence[int]) -> None:
    """Raise if a checkpoint tensor does not fit the parameter it is loaded into.

    Models call this from `load_weights` so a config/weights mismatch (e.g. a config.json from a
    different model size) fails with the tensor's name instead of a bare copy_() size error.
    """
    expected_t, got_t = tuple(int(d) for d in expected), tuple(int(d) for d in got)
    if expected_t != got_t:
        raise ModelLoadError(
            f"Weight '{name}' has shape {list(got_t)} in the checkpoint but the model built from "
            f"config.json expects {list(expected_t)}. The config and the weight files probably "
            "belong to different models."
        )


def unsupported_architecture_error(
    architecture: str | None, supported: Sequence[str], path: str
) -> ModelLoadError:
    """The error for a config.json whose `architectures` names a model we do not implement."""
    shown = architecture if architecture else "<none: config.json has no 'architectures' entry>"
    return ModelLoadError(
        f"Unsupported model architecture {shown} in {path}/config.json. "
        f"radixserve supports: {', '.join(supported)}."
    )
