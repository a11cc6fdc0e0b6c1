"""update_weights_from_disk with a GGUF conversion (or a .gguf file) as the new checkpoint.

A conversion of the current layout holds the dense weights only; the routed experts stay in the
GGUF file it names (model_loader/gguf_source.py). An update from such a folder must take the
experts from that file too, or the server would serve the new dense weights beside the old
experts without a word. Two cases:

- the server serves the file's own forms (--quantization gguf): the new file's forms are made
  before anything is written (a file that does not fit the model is refused then, the old weights
  kept), the dense weights are read from the conversion, and the new forms replace the old ones,
  experts included, without an fp32 copy of any expert. The peak holds both files' forms.
- otherwise (fp32 experts): the experts' tensors are read from the file, dequantized one expert at
  a time, as the rest of the checkpoint is.
"""

from __future__ import annotations

from typing import Any

from radixserve.layers.cpu_crossovers import active as active_crossovers
from radixserve.model_executor.weight_only_forms import WeightOnlyForms
from radixserve.model_loader.gguf_experts import file_expert_weights
from radixserve.model_loader.gguf_source import (
    ensure_gguf_converted,
    experts_source,
    gguf_source,
    is_gguf_file,
)
from radixserve.model_loader.gguf_weights import gguf_embedding_form, gguf_linear_forms
from radixserve.model_loader.weights import CheckpointTensor


def checkpoint_folder(model_path: str) -> str:
    """The folder to update from: a .gguf file's conversion (made as a start makes it, or the
    cached one), else `model_path` as given."""
    return ensure_gguf_converted(model_path, show_progress=False) if is_gguf_file(model_path) else model_path


def new_file_forms(runner: Any, folder: str, served: str) -> WeightOnlyForms | None:  # noqa: ANN401
    """The forms of the GGUF file `folder` converts, when the runner serves a GGUF file's forms and
    that file is not the one the weights were last loaded from (`served`: the start's folder or
    the last update's, whose file's forms are attached); None otherwise (the update writes fp32
    weights, and the forms of the layers it changed are dropped: weight_only_forms.py)."""
    current = runner.weight_only
    if runner.server_args.quantization != "gguf" or current is None:
        return None
    source = gguf_source(folder)
    if source is None or source == gguf_source(served):
        return None
    forms, expert_forms = gguf_linear_forms(source, runner.model, runner.lm_head, fresh_experts=True)
    embedding = gguf_embedding_form(source, runner.model)
    return WeightOnlyForms(
        current.method, forms, None, expert_forms, a8_panels=current.a8_panels, embedding=embedding
    )


def expert_weights(runner: Any, folder: str) -> list[tuple[str, CheckpointTensor]]:  # noqa: ANN401
    """The experts' tensors a conversion left in its GGUF file, for the layers that hold fp32
    experts (read lazily, one expert at a time); [] for a folder that holds every weight."""
    experts_file = experts_source(folder)
    if experts_file is None:
        return []
    return list(file_expert_weights(runner.model, experts_file, False, runner.device))


def swap_forms(runner: Any, forms: WeightOnlyForms) -> None:  # noqa: ANN401 - ModelRunner
    """Serve `forms` (new_file_forms) from now on: each MoE layer's experts from the new file's
    forms (their fp32 storage, if any, freed), on panels where the installed crossovers say so;
    the dense forms are attached, and checked against the weights just loaded, when the caller
    rebuilds the derived forms."""
    for _, moe, form in forms.expert_forms:
        moe.attach_quantized(form, forms.expert_scratch)
    forms.serve_experts(active_crossovers().moe_a8)
    runner.weight_only = forms
