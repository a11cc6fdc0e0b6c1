"""LoRAManager: the adapters in host memory, the compute pool, and the delta in the model's linears.

Built by the ModelRunner only with --enable-lora (without it no LoRA object exists and the
forward is untouched). It adds a forward hook to each adapted projection of the decoder layers
(qkv_proj with per-slice q/k/v deltas, o_proj, gate_up_proj with gate/up slices, down_proj);
before each forward, `prepare` puts the batch's adapters into slots and groups the token rows by
slot once, and every hook reads that grouping. A batch without adapter requests runs the hooks as
a single `None` check.

The CPU fused decode (model_executor/cpu_decode_runner.py) adds the same deltas inside its
compiled stack: it reads the pool's buffers in place (`fused_parts`) and each step's
`segments.token_slots`. Decode CUDA graphs stay off with --enable-lora (ServerArgs.resolve).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.parallel_linear import RowParallelLinear
from radixserve.lora.adapter import BaseShapes, LoRAAdapter, LoRAError, load_adapter
from radixserve.lora.kernels import LoRASegments, lora_delta
from radixserve.lora.pool import LoRAMemoryPool, LoRASlots
from radixserve.lora.tp_shards import local_shapes, rank_slices

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)

# fused projection -> its parent module and the PEFT modules it holds, in column order
_FUSED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


@dataclass(frozen=True)
class LoRAServeConfig:
    """The LoRA flags, resolved (ServerArgs.resolve) and frozen."""

    lora_paths: tuple[tuple[str, str], ...]  # (name, path) loaded at start
    max_loras_per_batch: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loaded_loras: int | None

    @classmethod
    def of(cls, args: Any) -> LoRAServeConfig:  # noqa: ANN401 - a resolved ServerArgs
        from radixserve.lora.adapter import parse_lora_paths

        return cls(
            tuple(parse_lora_paths(args.lora_paths).items()),
            args.max_loras_per_batch,
            int(args.max_lora_rank),
            tuple(args.lora_target_modules),
            args.max_loaded_loras,
        )


class LoRAManager:
    def __init__(
        self, config: LoRAServeConfig, model_config: Any, model: nn.Module, device: torch.device
    ) -> None:  # noqa: ANN401
        self.config = config
        self.base = BaseShapes.of_model(model_config)
        layers = range(model.model.start_layer, model.model.end_layer)
        dtype = model_config.dtype
        # This rank's part of every projection (all of it at TP 1): the slots hold the same part.
        slices = rank_slices(model.model.layers[layers.start])
        self.local_shapes = local_shapes(slices, self.base.shapes)
        self.pool = LoRAMemoryPool(
            config.max_loras_per_batch,
            config.max_lora_rank,
            config.target_modules,
            self.local_shapes,
            slices,
            layers,
            dtype,
            device,
        )
        self.slots = LoRASlots(config.max_loras_per_batch)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.device = device
        self.segments: LoRASegments | None = None  # the current forward's rows by slot
        self._slot_lock = threading.Lock()
        self._attach(model, layers)
        for name, path in config.lora_paths:
            self.load_adapter(name, path)

    # ------------------------------------------------------------------ adapters (host memory)
    def load_adapter(self, lora_id: str, path: str, name: str | None = None) -> LoRAAdapter:
        """Read adapter `name` (default: its id) into host memory under `lora_id`, the id
        requests name it by (an adapter loaded at start: its name)."""
        name = name or lora_id
        if lora_id in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        limit = self.config.max_loaded_loras
        if limit is not None and len(self.adapters) >= limit:
            raise LoRAError(
                f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loaded-loras allows"
            )
        adapter = load_adapter(name, path, self.base, self.config.max_lora_rank, self.config.target_modules)
        self.adapters[lora_id] = adapter
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank, adapter.target_modules
        )
        return adapter

    def unload_adapter(self, lora_id: str) -> None:
        if lora_id not in self.adapters:
            raise LoRAError(f"LoRA adapter {lora_id!r} is not loaded")
        del self.adapters[lora_id]
        with self._slot_lock:
            self.slots.drop(lora_id)

    # ------------------------------------------------------------------ per forward
    def prepare(self, batch: ModelWorkerBatch, num_tokens: int) -> None:
        """Slots for the batch's adapters (copied in when not resident) and its rows by slot."""
        ids = batch.lora_ids
        if ids is None or not any(ids):
            self.segments = None
            return
        wanted = {name for name in ids if name is not None}
        missing = wanted - set(self.adapters)
        if missing:  # the scheduler admits only loaded adapters; this is a broken invariant
            raise RuntimeError(f"a batch uses LoRA adapters that are not loaded: {sorted(missing)}")
        with self._slot_lock:  # the overlap loop prepares on its forward thread
            slot_of, to_load = self.slots.assign(wanted)
            for slot, name in to_load:
                self.pool.load(slot, self.adapters[name])
        per_req = torch.tensor([-1 if n is None else slot_of[n] for n in ids], dtype=torch.int64)
        counts = _tokens_per_request(batch, num_tokens)
        token_slots = torch.repeat_interleave(per_req, counts).to(self.device)  # [num_tokens]
        self.segments = LoRASegments.build(token_slots)

    # ------------------------------------------------------------------ model hooks
    def _parts(self, peft_modules: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
        """(module, column offset, width) of each adapted module in a fused projection's output:
        this rank's output columns of each, in the fused order."""
        parts, offset = [], 0
        for m in peft_modules:
            size = self.local_shapes[m][1]
            if m in self.config.target_modules:
                parts.append((m, offset, size))
            offset += size
        return tuple(parts)

    def fused_parts(self, layer: int) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]:
        """Per fused projection (qkv_proj, o_proj, gate_up_proj, down_proj) of `layer`, its adapted
        parts as (a [slots, rank, in], b [slots, rank, width], output column offset) over the
        pool's own buffers: the CPU fused decode (DecodeModel.set_layer_lora) reads them in place,
        so slot loads and evictions need nothing rebuilt."""
        pool = self.pool
        return {
            attr: [(pool.a[m][layer], pool.b[m][layer], offset) for m, offset, _ in self._parts(modules)]
            for _, attr, modules in _FUSED
        }

    def _attach(self, model: nn.Module, layers: range) -> None:
        for i in layers:
            layer = model.model.layers[i]
            for parent, attr, peft_modules in _FUSED:
                proj = getattr(getattr(layer, parent), attr)
                parts = self._parts(peft_modules)
                if not parts:
                    continue
                add = self._delta(i, parts)
                if isinstance(proj, RowParallelLinear) and proj.tp.size > 1:
                    proj.partial_delta = add  # a partial sum: before the layer's all-reduce
                else:
                    proj.register_forward_hook(lambda _module, args, out, add=add: add(args[0], out))

    def _delta(self, layer: int, parts: tuple[tuple[str, int, int], ...]) -> Callable[..., None]:
        pool = self.pool

        def add_delta(x: torch.Tensor, out: torch.Tensor) -> None:
            """x [num_tokens, in_features] (this rank's), out [num_tokens, out_features]."""
            segments = self.segments
            if segments is None:
                return
            for m, offset, size in parts:
                a, b = pool.a[m][layer], pool.b[m][layer]
                lora_delta(x, a, b, segments, out[:, offset : offset + size])

        return add_delta


def _tokens_per_request(batch: ModelWorkerBatch, num_tokens: int) -> torch.Tensor:
    """[bs] the token rows each request has in this forward (decode: 1; a verify step: its drafts)."""
    if batch.extend_seq_lens is not None:
        counts = list(batch.extend_seq_lens)
    else:
        bs = batch.batch_size
        counts = [num_tokens // bs] * bs
    if sum(counts) != num_tokens:
        raise RuntimeError(f"LoRA: {sum(counts)} rows by request for a forward of {num_tokens} tokens")
    return torch.tensor(counts, dtype=torch.int64)
