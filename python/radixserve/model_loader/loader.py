"""Build a model from a ModelConfig and fill its weights (from safetensors, or random for "dummy")."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from radixserve.configs.checkpoint_quant import CheckpointQuant
from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.moe.layer import experts_on_meta
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_source import experts_source
from radixserve.model_loader.weights import iterate_checkpoint

logger = logging.getLogger(__name__)

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
DUMMY_INIT_STD = 0.02
# Values drawn once for dummy init and tiled over big tensors (a prime, ~4 MB of fp32).
_RANDOM_POOL_SIZE = 1_048_573


def load_model(
    model_config: ModelConfig,
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    model_cls: type[nn.Module] | None = None,
    seed: int = 0,
    parallel: ModelParallelism | None = None,
    gguf_expert_forms: bool = False,
) -> nn.Module:
    """Construct the architecture's model class on `device` in `model_config.dtype`, load, eval().

    `model_cls` overrides the registry lookup (tests); `seed` only affects load_format="dummy".
    `parallel` (tensor/pipeline parallelism) makes the model hold only this rank's shards, and
    only those are read from the checkpoint. A GGUF conversion's routed experts come from the
    file (model_loader/gguf_experts.py): as its quantized forms with `gguf_expert_forms`
    (--quantization gguf), else in fp32, one expert at a time.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"Unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}.")
    cls = model_cls or get_model_class(model_config.architecture)
    if model_cls is None and not model_config.is_generation:
        from radixserve.models.sequence_classification import embedding_variant

        cls = embedding_variant(cls)  # a decoder served by --is-embedding: no LM head
    start = time.perf_counter()
    if load_format == "dummy":
        model = _build_dummy(cls, model_config, torch.device(device), seed, parallel)
    else:
        # Discover and validate the weight files before paying for model construction.
        weights = iterate_checkpoint(model_config.path)
        experts_file = experts_source(model_config.path)
        # Experts from a GGUF file are built without storage: forms or fp32 come from the file.
        with experts_on_meta() if experts_file else contextlib.nullcontext():
            model = _construct(cls, model_config, torch.device(device), parallel)
        if experts_file is not None:
            from radixserve.model_loader.gguf_experts import file_expert_weights

            experts = file_expert_weights(model, experts_file, gguf_expert_forms, torch.device(device))
            weights = itertools.chain(weights, experts)
        load_checkpoint_weights(model, weights, model_config.quantization)
    _finalize(model, model_config.dtype)
    logger.info(
        "Loaded %s (%s, %s weights, %.1f M params, %s) on %s in %.2f s",
        model_config.architecture,
        model_config.path,
        load_format,
        _num_params(model) / 1e6,
        str(model_config.dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return model


def load_checkpoint_weights(
    model: nn.Module, weights: Iterator[tuple[str, Any]], quantization: CheckpointQuant | None
) -> None:
    """Fill `model` from a checkpoint's tensors; a pre-quantized checkpoint (GPTQ, AWQ,
    compressed-tensors) also gives its linears their quantized forms (quantized_hf.py)."""
    if quantization is None:
        model.load_weights(weights)
        return
    from radixserve.model_loader.quantized_hf import load_quantized_weights

    load_quantized_weights(model, weights, quantization)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class radixserve.models registers for an HF architecture name."""
    try:
        from radixserve.models.registry import get_model_class as registry_lookup
    except ImportError as exc:
        raise ModelLoadError(
            f"The model registry (radixserve.models.registry) cannot be imported: {exc}"
        ) from exc
    try:
        return registry_lookup(architecture)
    except ModelLoadError:
        raise
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"No model implementation registered for {architecture}: {exc}") from exc


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Model code creates parameters with torch's default dtype, so set it for construction only.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _construct(
    cls: type[nn.Module],
    model_config: ModelConfig,
    device: torch.device,
    parallel: ModelParallelism | None = None,
) -> nn.Module:
    accepted = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {}
    if "max_position" in accepted:
        # Position tables must cover --context-length even past the checkpoint's own limit.
        kwargs["max_position"] = model_config.context_len
    if parallel is not None and (parallel.tp.size > 1 or parallel.pp_size > 1):
        if "parallel" not in accepted:
            raise ModelLoadError(f"{cls.__name__} does not support tensor or pipeline parallelism")
        kwargs["parallel"] = parallel
    with torch.device(device), _default_dtype(model_config.dtype):
        model = cls(model_config.hf_config, **kwargs)
    if not callable(getattr(model, "load_weights", None)):
        raise ModelLoadError(f"{cls.__name__} has no load_weights(weights) method.")
    return model


# ---------------------------------------------------------------------------------------------
# Dummy weights: parameters are created on the meta device (no memory, no default init, which
# for an 8B model costs more than the allocation itself), then allocated once and filled with
# torch.nn.init directly. Buffers (rotary caches, ...) are still computed on the real device.
# ---------------------------------------------------------------------------------------------


def _build_dummy(
    cls: type[nn.Module],
    model_config: ModelConfig,
    device: torch.device,
    seed: int,
    parallel: ModelParallelism | None = None,
) -> nn.Module:
    with _parameters_on_meta():
        model = _construct(cls, model_config, device, parallel)
    _materialize_parameters(model, device)
    _init_dummy_weights(model, device, seed)
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Make every nn.Parameter registered inside the block live on the meta device."""
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            # Keep attributes such as a custom weight_loader that model code attached.
            meta.__dict__.update(param.__dict__)
            param = meta
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _materialize_parameters(model: nn.Module, device: torch.device) -> None:
    # Keyed by the meta parameter so tied weights (lm_head = embed_tokens) stay one tensor.
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                replaced[id(param)] = (param, real)
            module._parameters[name] = replaced[id(param)][1]
    leftovers = [name for name, buf in model.named_buffers() if buf.is_meta]
    if leftovers:
        raise ModelLoadError(f"Dummy load left buffers on the meta device: {', '.join(leftovers[:5])}")


def _init_dummy_weights(model: nn.Module, device: torch.device, seed: int) -> None:
    """Small normal weights, unit norm scales, zero biases: finite, non-degenerate logits."""
    generator = torch.Generator(device=device).manual_seed(seed)
    pool = torch.empty(_RANDOM_POOL_SIZE, device=device).normal_(0.0, DUMMY_INIT_STD, generator=generator)
    with torch.no_grad():
        for name, param in model.named_parameters():  # shared parameters are listed once
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 1:
                nn.init.ones_(param)  # RMSNorm/LayerNorm scales (incl. Qwen3 q_norm/k_norm)
            elif param.numel() <= _RANDOM_POOL_SIZE or not param.is_contiguous():
                nn.init.normal_(param, mean=0.0, std=DUMMY_INIT_STD, generator=generator)
            else:
                offset = int(torch.randint(_RANDOM_POOL_SIZE, (1,), generator=generator, device=device))
                _fill_tiled(param.view(-1), pool, offset)


def _fill_tiled(flat: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """Fill `flat` with `pool` repeated, starting at `offset`.

    Generating normals runs at ~0.2 G values/s per CPU core; copying is ~50x faster, which is the
    difference between seconds and a minute for an 8B dummy model. The pool length is prime, so
    the repetition never lines up with a row and every row sees different values.
    """
    rotated = torch.cat([pool[offset:], pool[:offset]]).to(flat.dtype)
    size = rotated.numel()
    reps, rest = divmod(flat.numel(), size)
    if reps:
        flat[: reps * size].view(reps, size).copy_(rotated.expand(reps, size))
    if rest:
        flat[reps * size :].copy_(rotated[:rest])


def _finalize(model: nn.Module, dtype: torch.dtype) -> None:
    for param in model.parameters():
        # Only floating weights: integer/quantized parameters keep their storage type.
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    model.requires_grad_(False)  # serving never backpropagates; skips autograd bookkeeping
    model.eval()


def _num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
