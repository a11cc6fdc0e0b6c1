"""Weight updates for RL (seed 002 §4.5, INVENTORY §36): the scheduler's side of
/update_weights_from_disk, /update_weights_from_tensor, the trainer's weight group
(/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group)
and /get_weights_by_name; beside them, memory release / resume (/release_memory_occupation,
/resume_memory_occupation), which frees and reloads the same weights and the KV pool.

The ControlPlane runs the updates and the memory operations only when no forward is in flight and no request is alive (or
generation is paused), so a request never mixes old and new weights. Each rank updates its own
shard; the outcome is agreed over the ranks (all applied, or all kept the old weights) before
rank 0 answers (`agree`). After a successful update the prefix cache is flushed (`flush_cache`, default
true): its KV was computed with the old weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.distributed.rank_runtime import RankSync
from radixserve.managers.io_struct import (
    MEMORY_TAGS,
    ControlOutcome,
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from radixserve.model_executor.tensor_payload import decode_entry, serialize_named_tensors
from radixserve.model_executor.weight_read import WeightReadError, assemble, read_piece
from radixserve.model_executor.weight_sync import WeightUpdateError
from radixserve.scheduler.activity import Activity
from radixserve.scheduler.kv_memory import KVMemory

logger = logging.getLogger(__name__)

__all__ = [
    "MemoryOccupation",
    "WeightControl",
    "agree",
    "parse_dtype",
    "serialize_named_tensors",
]  # the last: docs/rl.md's import

# Largest tensor a trainer may announce for one broadcast (elements), so a typo in `shapes`
# cannot make the server allocate terabytes.
MAX_BROADCAST_NUMEL = 1 << 34
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise WeightUpdateError(f"Unsupported dtype {name!r}: use one of {sorted(_DTYPES)}.")
    return _DTYPES[key]


def agree(sync: RankSync, ok: bool, message: str) -> tuple[bool, str]:
    """Every rank's outcome: success only if all succeeded, else the first failure's message."""
    outcomes = sync.gather((ok, message))
    failures = [m for o, m in outcomes if not o]  # type: ignore[misc]
    return (True, message) if not failures else (False, str(failures[0]))


class WeightControl:
    def __init__(
        self,
        weights: Any,  # noqa: ANN401 - the worker's ModelWeights; None for test workers
        tp_rank: int,
        sync: RankSync,
        activity: Activity,
        mem: KVMemory,
        flush_cache: Callable[[], object],
        weight_version: str,
    ) -> None:
        self.weights = weights
        self.tp_rank = tp_rank
        self.sync = sync
        self.activity = activity
        self.mem = mem
        self.flush_cache = flush_cache
        self.weight_version = weight_version
        self.groups: dict[str, Any] = {}  # group_name -> torch ProcessGroup with the trainer
        # The version of the last checkpoint loaded from disk: what a memory resume reloads.
        self.disk_version = weight_version

    def on_weights_reloaded(self) -> str:
        """The weights came back from the last checkpoint on disk: so does their version."""
        self.weight_version = self.disk_version
        return self.weight_version

    def _weights(self) -> Any:  # noqa: ANN401 - ModelWeights
        if self.weights is None:
            raise WeightUpdateError("This worker cannot update weights.")
        if self.weights.released_shapes is not None:
            raise WeightUpdateError("The weights are released: call /resume_memory_occupation first.")
        return self.weights

    # ------------------------------------------------------------------ updates
    def _run_update(self, what: str, update: Any, flush_cache: bool, version: str | None) -> tuple[bool, str]:  # noqa: ANN401
        try:
            update()
            ok, message = True, ""
        except WeightUpdateError as exc:
            ok, message = False, str(exc)
        except Exception as exc:  # never leave the scheduler: report the failure
            logger.exception("Weight update (%s) failed", what)
            ok, message = False, f"{type(exc).__name__}: {exc}"
        ok, message = agree(self.sync, ok, message)
        if not ok:
            logger.warning("Weight update (%s) refused: %s", what, message)
            return False, f"Failed to update weights: {message}"
        if version is not None:
            self.weight_version = version
        self.mem.tree_cache.weights_updated()
        message = f"Succeeded to update model weights ({what}); weight_version {self.weight_version}."
        if flush_cache:
            message += " " + self._flush()
        logger.info(message)
        return True, message

    def _flush(self) -> str:
        if self.activity.quiescent():
            self.flush_cache()
            return "Cache flushed."
        # Paused requests still hold their prefixes: drop every cached entry nobody holds.
        freed = self.mem.tree_cache.evict_stale()
        return f"Paused requests keep their KV; {freed} cached token(s) evicted."

    def update_from_disk(self, msg: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        ok, message = self._run_update(
            f"from {msg.model_path}",
            lambda: self._weights().update_from_disk(msg.model_path, msg.load_format),
            msg.flush_cache,
            msg.weight_version,
        )
        if ok:
            self.disk_version = self.weight_version
        return UpdateWeightFromDiskReqOutput(ok, message, 0, self.weight_version if ok else None)

    def update_from_tensor(self, msg: UpdateWeightsFromTensorReqInput) -> ControlOutcome:
        def update() -> None:
            rank = self.tp_rank
            entries = msg.serialized_named_tensors
            if not entries:
                raise WeightUpdateError("serialized_named_tensors is empty.")
            # One entry per TP rank (SGLang's layout); a single entry serves every rank when it
            # can be read more than once (radixserve's torch.save, SGLang's with file_system).
            data = entries[rank] if len(entries) > rank else entries[0]
            payload = decode_entry(data, msg.load_format, rank)
            if payload.direct:
                self._weights().update_direct(payload.named)
            else:
                self._weights().update_from_tensors(payload.named)

        ok, message = self._run_update("from tensors", update, msg.flush_cache, msg.weight_version)
        return ControlOutcome(ok, message, self.weight_version if ok else None)

    # ------------------------------------------------------------------ the trainer's group
    def init_group(self, msg: InitWeightsUpdateGroupReqInput) -> ControlOutcome:
        from radixserve.model_executor.weight_group import init_weights_group

        created = False
        try:
            if msg.group_name in self.groups:
                raise WeightUpdateError(f"Weight update group {msg.group_name!r} already exists.")
            rank = msg.rank_offset + self.tp_rank
            self.groups[msg.group_name] = init_weights_group(
                msg.master_address, msg.master_port, rank, msg.world_size, msg.group_name, msg.backend
            )
            created = True
            ok, message = True, ""
        except Exception as exc:  # bad address, timeout, bad rank: report, keep serving
            ok, message = False, f"{type(exc).__name__}: {exc}"
        ok, message = agree(self.sync, ok, message)
        if not ok:
            if created:  # another rank failed: this rank leaves the group too
                self.groups.pop(msg.group_name, None)
            return ControlOutcome(False, f"Failed to init the weight update group: {message}")
        logger.info("Joined weight update group %s", msg.group_name)
        return ControlOutcome(True, "Succeeded to initialize the weight update group.")

    def update_from_distributed(self, msg: UpdateWeightsFromDistributedReqInput) -> ControlOutcome:
        from radixserve.model_executor.weight_group import broadcast_from_trainer

        def update() -> None:
            group = self.groups.get(msg.group_name)
            if group is None:
                raise WeightUpdateError(
                    f"No weight update group {msg.group_name!r}: call /init_weights_update_group."
                )
            if not len(msg.names) == len(msg.dtypes) == len(msg.shapes):
                raise WeightUpdateError("names, dtypes and shapes must have the same length.")
            specs = []  # everything checked before the first broadcast is received
            for name, dtype, shape in zip(msg.names, msg.dtypes, msg.shapes):
                numel = 1
                for d in shape:
                    numel *= int(d)
                if any(int(d) < 0 for d in shape) or numel > MAX_BROADCAST_NUMEL:
                    raise WeightUpdateError(f"Bad shape {shape} for {name!r}.")
                specs.append((name, parse_dtype(dtype), [int(d) for d in shape]))
            received = []
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype)
                broadcast_from_trainer(group, tensor)
                received.append((name, tensor))
            self._weights().update_from_tensors(received)

        ok, message = self._run_update("from distributed", update, msg.flush_cache, msg.weight_version)
        return ControlOutcome(ok, message, self.weight_version if ok else None)

    def destroy_group(self, msg: DestroyWeightsUpdateGroupReqInput) -> ControlOutcome:
        group = self.groups.pop(msg.group_name, None)
        ok, message = agree(self.sync, group is not None, f"No weight update group {msg.group_name!r}.")
        if not ok:
            return ControlOutcome(False, message)
        del group  # the ProcessGroup closes its connections when collected
        return ControlOutcome(True, "Succeeded to destroy the weight update group.")

    # ------------------------------------------------------------------ reading
    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        """The first `truncate_size` rows of the full checkpoint tensor: every rank reads its part
        (TP shards, the PP stage holding it) and the parts are gathered (weight_read.py)."""
        piece, error = None, ""
        try:
            if self.weights is None:
                raise WeightReadError("This worker cannot read weights.")
            piece = read_piece(self.weights.model, msg.name, msg.truncate_size)
        except WeightReadError as exc:
            error = str(exc)
        gathered = self.sync.gather((piece, error))  # every rank takes part, in rank order
        errors = [e for _, e in gathered if e]  # type: ignore[misc]
        if errors:
            return GetWeightsByNameReqOutput(None, False, str(errors[0]))
        try:
            tensor = assemble([p for p, _ in gathered], msg.truncate_size)  # type: ignore[misc]
        except WeightReadError as exc:
            message = f"The model has no weight named {msg.name!r} ({exc})."
            return GetWeightsByNameReqOutput(None, False, message)
        # An array crosses the socket as bytes; the HTTP side writes the JSON off its event loop.
        return GetWeightsByNameReqOutput(tensor.numpy() if tensor.dim() else tensor.item())


class MemoryOccupation:
    """/release_memory_occupation and /resume_memory_occupation: free the KV pool and / or the
    weights while the server idles (an RL trainer takes the memory), and bring them back."""

    def __init__(
        self,
        weights: Any,  # noqa: ANN401 - the worker's ModelWeights; None for test workers
        sync: RankSync,
        activity: Activity,
        mem: KVMemory,
        weight_control: WeightControl,
    ) -> None:
        self.weights = weights
        self.sync = sync
        self.activity = activity
        self.mem = mem
        self.weight_control = weight_control
        self.released: set[str] = set()  # MEMORY_TAGS currently released

    def release(self, msg: ReleaseMemoryOccupationReqInput) -> ControlOutcome:
        tags, error = _tags(msg.tags)
        if error is None and not self.activity.quiescent():
            error = "Cannot release memory while requests are alive (paused in place?): abort or finish them first."
        weights = self.weights
        if error is None and weights is None:
            error = "This worker cannot release memory."
        if error is not None:
            return ControlOutcome(False, error)
        before = _rss()
        if "kv_cache" in tags:
            self.mem.flush()  # the cached prefixes' KV is about to go
            weights.release_kv_cache()
        if "weights" in tags:
            weights.release_weights()
        self.released.update(tags)
        message = f"Released {', '.join(sorted(tags))}: process RSS {before / 2**20:.0f} -> {_rss() / 2**20:.0f} MiB."
        logger.info(message)
        return ControlOutcome(True, message)

    def resume(self, msg: ResumeMemoryOccupationReqInput) -> ControlOutcome:
        tags, error = _tags(msg.tags)
        weights = self.weights
        if error is None and weights is None:
            error = "This worker cannot resume memory."
        if error is not None:
            return ControlOutcome(False, error)
        ok, message = True, ""
        try:
            if "kv_cache" in tags:
                weights.resume_kv_cache()
            if "weights" in tags:
                weights.resume_weights()
        except Exception as exc:  # e.g. the checkpoint went away: stay released, say why
            logger.exception("Resuming memory failed")
            ok, message = False, f"Resume failed: {exc}"
        ok, message = agree(self.sync, ok, message)
        version = None
        if ok:
            self.released.difference_update(tags)
            message = f"Resumed {', '.join(sorted(tags))}: process RSS {_rss() / 2**20:.0f} MiB."
            if "weights" in tags:
                version = self.weight_control.on_weights_reloaded()
                message += f" Weights reloaded from {weights.source_path} (weight_version {version})."
            logger.info(message)
        return ControlOutcome(ok, message, version)

    def released_message(self) -> str | None:
        if not self.released:
            return None
        return (
            f"The server's memory ({', '.join(sorted(self.released))}) is released: call "
            "/resume_memory_occupation before generating."
        )


def _tags(tags: list[str] | None) -> tuple[set[str], str | None]:
    chosen = set(MEMORY_TAGS if tags is None else tags)
    unknown = sorted(chosen - set(MEMORY_TAGS))
    if unknown:
        return chosen, f"Unknown memory tag(s) {unknown}: use {list(MEMORY_TAGS)} or null for both."
    return chosen, None


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss
