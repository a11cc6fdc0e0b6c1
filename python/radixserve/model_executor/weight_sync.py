"""Changing a loaded model's weights in place: updates for RL (from disk, from tensors, from a
trainer's broadcast) and releasing / restoring weights and the KV pool (reading one back:
weight_read.py).

Updates are transactional: every parameter an update touches is copied aside first, and any
failure (an unknown name, a shape the config does not imply, an unreadable file) puts the copies
back before the error is reported, so the server keeps serving the old weights. The price is a
second copy of the touched parameters while the update runs (all of them for a full checkpoint).

Parameters are updated with copy_ into their existing storage, so every view of them (the tied LM
head, the fused decode path's tensors) sees the new values; the CPU linears' derived forms (fp16
copies, oneDNN-packed weights) are rebuilt and the fused decode runner recreated afterwards.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.cpu_crossovers import active as active_crossovers
from radixserve.layers.linear import Linear
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.vocab_parallel import VocabParallelEmbedding
from radixserve.model_executor import gguf_update
from radixserve.model_executor.cpu_decode_runner import create_cpu_decode_runner
from radixserve.model_executor.cpu_tuning import install_tuned_forms
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_experts import file_expert_weights
from radixserve.model_loader.gguf_source import experts_source
from radixserve.model_loader.loader import _init_dummy_weights, load_checkpoint_weights
from radixserve.model_loader.weights import CheckpointTensor, iterate_checkpoint

if TYPE_CHECKING:
    from radixserve.model_executor.weight_only_forms import WeightOnlyForms

logger = logging.getLogger(__name__)


class WeightUpdateError(ValueError):
    """A weight update that was refused; the old weights are still loaded."""


def _trim_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps large freed blocks otherwise), and freed
    CUDA blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator decides
        pass


def _check_tensor(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WeightUpdateError(f"Weight {name!r} is a {type(tensor).__name__}, not a tensor.")
    if not tensor.is_floating_point():
        raise WeightUpdateError(
            f"Weight {name!r} has dtype {tensor.dtype}; the model's weights are floating point."
        )


class ModelWeights:
    """The weight operations of one rank's ModelRunner (`runner`)."""

    def __init__(self, runner: Any) -> None:  # noqa: ANN401 - ModelRunner (imports this module)
        self.runner = runner
        # Where the weights come back from after a release: the last checkpoint loaded from disk.
        self.source_path: str = runner.model_config.path
        self.source_format: str = runner.server_args.load_format
        self.released_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self.released_kv: tuple[torch.Size, torch.dtype] | None = None
        # CUDA graphs read the weights' and the KV pool's storage: dropped on a release, captured
        # again once both are back (in-place updates keep the storage, and the graphs valid).
        self._had_graphs = getattr(runner, "graph_runner", None) is not None

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    # ------------------------------------------------------------------ updates
    def update_from_disk(self, model_path: str, load_format: str | None) -> None:
        """Load every weight of the checkpoint at `model_path` (same architecture and shapes)."""
        self._refuse_if_prequantized()
        fmt = load_format or "auto"
        if fmt not in ("auto", "safetensors"):
            raise WeightUpdateError(
                f"load_format {fmt!r} cannot update weights (use 'auto' or 'safetensors')."
            )
        try:
            # A .gguf file: its conversion; a conversion's experts from its GGUF file (gguf_update.py).
            folder = gguf_update.checkpoint_folder(model_path)
            self._check_architecture(folder)
            forms = gguf_update.new_file_forms(self.runner, folder, self.source_path)
            weights = list(iterate_checkpoint(folder, show_progress=False))
            if forms is None:
                weights += gguf_update.expert_weights(self.runner, folder)
        except ModelLoadError as exc:
            raise WeightUpdateError(str(exc)) from exc
        self._load(weights, require_all=True, forms=forms)
        self.source_path, self.source_format = folder, "auto"

    def update_from_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a subset of the weights from in-memory tensors (checkpoint names)."""
        self._refuse_if_prequantized()
        named = list(named)
        for name, tensor in named:
            _check_tensor(name, tensor)
        self._load([(n, CheckpointTensor.of(n, t.detach().cpu())) for n, t in named], require_all=False)

    def update_direct(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang's load_format 'direct': tensors by the model's own parameter names (fused
        qkv_proj / gate_up_proj, this rank's shard), copied as they are. Everything is checked
        before the first copy, so a refusal changes nothing."""
        self._refuse_if_prequantized()
        named = list(named)
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            _check_tensor(name, tensor)
            if name not in params:
                raise WeightUpdateError(
                    f"The model has no parameter named {name!r} (load_format 'direct' takes the "
                    f"server's own parameter names, e.g. {next(iter(params))!r})."
                )
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightUpdateError(
                    f"Shape mismatch for {name}: this rank's parameter is {tuple(params[name].shape)}, "
                    f"the tensor {tuple(tensor.shape)}."
                )
        self._materialize_experts(name for name, _ in named)
        with torch.no_grad():
            for name, tensor in named:
                params[name].data.copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
        self.rebuild_derived()
        _trim_heap()

    def _refuse_if_prequantized(self) -> None:
        spec = self.runner.model_config.quantization
        if spec is not None:
            raise WeightUpdateError(
                f"The server runs a pre-quantized checkpoint ({spec.describe()}): its quantized weights "
                "come from the checkpoint's integers, and updating them in place is not supported yet. "
                "Restart the server with the new checkpoint."
            )

    def _check_architecture(self, model_path: str) -> None:
        config_file = os.path.join(model_path, "config.json")
        try:
            with open(config_file, encoding="utf-8") as f:
                archs = json.load(f).get("architectures") or []
        except (OSError, ValueError) as exc:
            raise WeightUpdateError(f"Cannot read {config_file}: {exc}") from exc
        mine = self.runner.model_config.architecture
        if mine not in archs:
            raise WeightUpdateError(
                f"The checkpoint at {model_path} is a {', '.join(archs) or 'model of unknown architecture'}; "
                f"the server runs {mine}. Weight updates keep the architecture."
            )

    def _materialize_experts(self, param_names: Iterable[str]) -> None:
        """Quantized MoE experts and a GGUF token embedding hold no fp32 copy (layers/moe/quantized.py,
        layers/vocab_parallel.py): bring back those an update writes into; the rebuild drops them
        again where nothing changed."""
        for name in param_names:
            owner = self.model.get_submodule(name.rpartition(".")[0]) if "." in name else self.model
            if isinstance(owner, (FusedMoE, VocabParallelEmbedding)):
                owner.materialize_fp32()

    def _load(
        self,
        weights: list[tuple[str, CheckpointTensor]],
        require_all: bool,
        forms: WeightOnlyForms | None = None,
    ) -> None:
        """Load `weights` (all or nothing); with `forms` (another GGUF file's), serve them after."""
        model = self.model
        params = dict(model.named_parameters())
        touched: set[str] = set()
        for name, _ in weights:
            targets = model.param_targets(name)
            unknown = [t for t in targets if t not in params]
            if unknown or (not targets and not self._other_stage_or_skipped(name)):
                raise WeightUpdateError(f"The model has no weight named {name!r}.")
            touched.update(targets)
        if not touched and weights and self.runner.parallel.pp_size == 1:
            raise WeightUpdateError("None of the given weights belongs to the model.")
        self._materialize_experts(touched)  # swaps storage in place: `params` stays valid
        backup = {n: params[n].detach().clone() for n in touched}
        try:
            model.load_weights(weights, require_all=require_all)
        except (ModelLoadError, RuntimeError, ValueError) as exc:
            with torch.no_grad():
                for n, saved in backup.items():
                    params[n].data.copy_(saved)
            raise WeightUpdateError(f"{exc} (the previous weights are kept)") from exc
        finally:
            del backup
        if forms is not None:
            gguf_update.swap_forms(self.runner, forms)
        self.rebuild_derived()
        _trim_heap()

    def _other_stage_or_skipped(self, name: str) -> bool:
        """A checkpoint name this rank skips on purpose (another pipeline stage, a tied head)."""
        if "rotary_emb.inv_freq" in name:
            return True
        if name.startswith("lm_head.") and getattr(self.model, "tie_word_embeddings", False):
            return True
        return self.runner.parallel.pp_size > 1

    def rebuild_derived(self) -> None:
        """Recompute every form derived from the weights (CPU linears, fused decode runner)."""
        runner = self.runner
        runner.cpu_decode_runner = None
        if self.released_shapes is not None:
            return  # nothing to derive from until the weights are back
        # A pre-quantized checkpoint's forms are not derived from the weights: they stay.
        kept = [(m, m.weight_int8, m.weight_scale, m.weight_wq) for m in self._checkpoint_quantized()]
        for layer in self._linears():
            layer.drop_derived()
        for layer, weight_int8, weight_scale, weight_wq in kept:
            layer.weight_int8, layer.weight_scale, layer.weight_wq = weight_int8, weight_scale, weight_wq
        runner._prepare_cpu_linears()
        if runner.device.type == "cpu" and runner.model_config.dtype == torch.float32:
            # The tuned forms (panels, bf16 batch copies) went with the derived ones: made again.
            modules = [m for m in (runner.model, runner.lm_head) if m is not None]
            install_tuned_forms(modules, active_crossovers())
        if self.released_kv is not None:
            return  # the fused decode path reads the KV pool: recreated when it is back
        runner.cpu_decode_runner = create_cpu_decode_runner(
            runner.model,
            runner.token_to_kv_pool,
            runner.server_args,
            runner.parallel,
            runner.lora,
            runner.max_req_num,
        )
        if self._had_graphs and runner.graph_runner is None:
            from radixserve.model_executor.cuda_graph_runner import create_cuda_graph_runner

            runner.graph_runner = create_cuda_graph_runner(runner, runner.server_args)

    def _checkpoint_quantized(self) -> list[Linear]:
        if self.runner.model_config.quantization is None:
            return []
        return [m for m in self._linears() if m.weight_int8 is not None or m.weight_wq is not None]

    def _linears(self) -> list[Linear]:
        roots = [m for m in (self.runner.model, self.runner.lm_head) if m is not None]
        return [m for root in roots for m in root.modules() if isinstance(m, Linear)]

    # ------------------------------------------------------------------ release / resume
    def release_weights(self) -> None:
        if self.released_shapes is not None:
            return
        self.runner.cpu_decode_runner = self.runner.graph_runner = None
        for layer in self._linears():
            layer.drop_derived()
        for moe in self.model.modules():
            if isinstance(moe, FusedMoE):
                moe.experts_int8 = None  # remade from the fp32 experts, or the checkpoint's, on resume
        shapes = {}
        for name, param in self.model.named_parameters():
            shapes[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.released_shapes = shapes
        _trim_heap()

    def resume_weights(self) -> None:
        """Reallocate and reload from the last checkpoint loaded from disk (`source_path`), or
        re-draw the random weights of load_format 'dummy'."""
        if self.released_shapes is None:
            return
        params = dict(self.model.named_parameters())
        for name, (shape, dtype) in self.released_shapes.items():
            owner = self.model.get_submodule(name.rpartition(".")[0]) if "." in name else self.model
            # Experts served from quantized forms (kept through the release) stay without fp32.
            on_meta = isinstance(owner, FusedMoE) and owner.experts_wq is not None
            data = torch.empty(shape, dtype=dtype, device="meta" if on_meta else self.runner.device)
            if params[name].is_meta or on_meta:  # `.data =` cannot move to or from meta
                torch.utils.swap_tensors(params[name], nn.Parameter(data, requires_grad=False))
            else:
                params[name].data = data
        if self.source_format == "dummy":
            _init_dummy_weights(self.model, self.runner.device, 0)
        else:
            weights = iterate_checkpoint(self.source_path, show_progress=False)
            experts_file = experts_source(self.source_path)
            if experts_file is not None:  # a GGUF conversion: the other experts come from the file
                experts = file_expert_weights(self.model, experts_file, False, self.runner.device)
                weights = itertools.chain(weights, experts)
            load_checkpoint_weights(self.model, weights, self.runner.model_config.quantization)
        self.released_shapes = None
        self.rebuild_derived()

    def release_kv_cache(self) -> None:
        pool = self.runner.token_to_kv_pool
        if self.released_kv is not None:
            return
        self.runner.cpu_decode_runner = self.runner.graph_runner = None
        self.released_kv = (pool.k_buffer[0].shape, pool.dtype)
        empty = torch.empty(0, dtype=pool.dtype, device=pool.device)
        pool.k_buffer = [empty] * pool.num_layers
        pool.v_buffer = [empty] * pool.num_layers
        _trim_heap()

    def resume_kv_cache(self) -> None:
        if self.released_kv is None:
            return
        pool = self.runner.token_to_kv_pool
        shape, dtype = self.released_kv
        pool.k_buffer = [torch.zeros(shape, dtype=dtype, device=pool.device) for _ in range(pool.num_layers)]
        pool.v_buffer = [torch.zeros(shape, dtype=dtype, device=pool.device) for _ in range(pool.num_layers)]
        self.released_kv = None
        self.rebuild_derived()
