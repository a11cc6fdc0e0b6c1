"""Shared-memory all-reduce and all-gather for the ranks of one host (sgl-kernel's `ShmComm`).

Tensor parallelism all-reduces each decoder layer's o_proj and down_proj outputs and all-gathers
the LM head's vocab shards on every step. Over gloo each call is a TCP loopback round trip; here
every rank copies its input into a region of /dev/shm that all ranks map, publishes a sequence
number, spins until every peer has published the same one, and sums the inputs itself in rank
order, so every rank holds bit-identical results (they all sample from the same logits).
benchmark/bench_all_reduce.py measures both.

The region is a file that rank 0 creates under /dev/shm and unlinks as soon as every rank has
mapped it: the memory is freed when the last rank exits, however it exits (SIGKILL included).
A wait never hangs: a dead or closed peer makes the others raise RuntimeError within ~50 ms, and
any wait past `timeout_s` raises too. After a failed collective the communicator refuses further
calls (the ranks are out of step).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from sgl_kernel import cpu as cpu_kernels
except ImportError:  # sgl-kernel not installed
    cpu_kernels = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# Per rank, per buffer: larger tensors go in slot-sized chunks (one handshake each, ~1 us against
# ~40 us to copy and sum 1 MiB). The region (2 x world x slot) is reserved up front, so it stays
# small: 4 MiB at 2 ranks, 16 MiB at 8 (a container's /dev/shm is often 64 MiB).
DEFAULT_SLOT_BYTES = 1 << 20
# How long one wait may last while every peer is alive and attached (a dead peer raises at once).
DEFAULT_TIMEOUT_S = 300.0
SHM_DIR = Path("/dev/shm")
_PREFIX = "radixserve-shm"


def _host_id() -> tuple[str, str]:
    """(hostname, boot id): ranks in containers on different hosts may share a hostname."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_regions() -> None:
    """Unlink regions left by a creator that died between creating and unlinking (a window of one
    handshake): their names carry the creator's pid."""
    for path in SHM_DIR.glob(f"{_PREFIX}-*"):
        try:
            pid = int(path.name.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)


def _region_path(name_hint: str) -> Path:
    hint = re.sub(r"[^A-Za-z0-9_]", "_", name_hint)[:32] or "comm"
    return SHM_DIR / f"{_PREFIX}-{hint}-{os.getpid()}-{secrets.token_hex(4)}"


def _gather(obj: object, group: dist.ProcessGroup) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _why_not_shared(group: dist.ProcessGroup) -> str | None:
    """Why the group cannot use shared memory (the same answer on every rank), or None."""
    built = cpu_kernels is not None and cpu_kernels.shm_comm_available()
    peers = _gather((built, _host_id(), SHM_DIR.is_dir()), group)
    if not all(ok for ok, _, _ in peers):
        return "sgl_kernel._cpu.ShmComm is not built on every rank"
    if len({host for _, host, _ in peers}) != 1:
        return "the ranks are not on one host"
    if not all(has_dir for _, _, has_dir in peers):
        return f"{SHM_DIR} is missing"
    return None


def _map_region(
    group: dist.ProcessGroup, name_hint: str, slot_bytes: int, timeout_s: float
) -> tuple[object | None, str | None]:
    """Rank 0 creates the region, every other rank maps it, then rank 0 unlinks its name (the
    mapping keeps the memory until the last rank exits). Returns (ShmComm, None) on every rank,
    or (None, why) on every rank."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    handle, error = None, None
    path = str(_region_path(name_hint)) if rank == 0 else ""
    if rank == 0:
        try:
            _sweep_stale_regions()
            handle = cpu_kernels.shm_comm(path, 0, world_size, slot_bytes, True, timeout_s)
        except (OSError, RuntimeError) as exc:
            error = str(exc)
    path, error = _gather((path, error), group)[0]
    if error is not None:
        return None, f"rank 0 could not create the region: {error}"
    if rank != 0:
        try:
            handle = cpu_kernels.shm_comm(path, rank, world_size, slot_bytes, False, timeout_s)
        except RuntimeError as exc:
            error = str(exc)
    attached = _gather(error, group)
    if rank == 0:  # every rank has mapped it or failed to: the name is no longer needed
        Path(path).unlink(missing_ok=True)
    failed = [(r, e) for r, e in enumerate(attached) if e is not None]
    if failed:
        if handle is not None:
            handle.close()
        return None, f"rank {failed[0][0]} could not attach: {failed[0][1]}"
    if not handle.peers_visible():  # every peer is attached and alive now, so it should be
        handle.check_peer_pids = False
        logger.warning(
            "Rank %d cannot see its peers' processes (another PID namespace?): a dead peer is "
            "noticed only by the %.0f s timeout",
            rank,
            timeout_s,
        )
    return handle, None


class ShmCommunicator:
    """Collectives over shared memory for the ranks of one gloo group on one host. Every rank must
    call the same collectives in the same order with the same shapes (as with torch.distributed).
    Use it from one thread per rank."""

    def __init__(self, handle: object) -> None:
        self._handle = handle

    @classmethod
    def create(
        cls,
        cpu_group: dist.ProcessGroup,
        name_hint: str = "tp",
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ShmCommunicator | None:
        """Collective over `cpu_group` (every rank must call it, with the same arguments): a
        communicator on every rank, or None on every rank (rank 0 logs why) when the extension is
        not built, the ranks are not on one host, or the region cannot be made or mapped."""
        if timeout_s <= 0 or slot_bytes <= 0:
            raise ValueError("ShmCommunicator.create: slot_bytes and timeout_s must be positive")
        rank = dist.get_rank(cpu_group)
        slot_bytes = (int(slot_bytes) + 63) // 64 * 64  # slots start on cache lines
        reason = _why_not_shared(cpu_group)
        handle = None
        if reason is None:
            handle, reason = _map_region(cpu_group, name_hint, slot_bytes, timeout_s)
        if handle is None:
            if rank == 0:
                logger.info("Shared-memory collectives off, using gloo: %s", reason)
            return None
        if rank == 0:
            logger.info(
                "Shared-memory collectives over %d ranks (%d KiB slots, %.0f s timeout)",
                handle.world_size,
                slot_bytes >> 10,
                timeout_s,
            )
        return cls(handle)

    @property
    def handle(self) -> object:
        """The sgl_kernel._cpu.ShmComm, for C++ users (DecodeModel.set_tp_comm)."""
        return self._handle

    @property
    def rank(self) -> int:
        return self._handle.rank

    @property
    def world_size(self) -> int:
        return self._handle.world_size

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place SUM over the ranks of an fp32 or bf16 CPU tensor (bf16 adds in fp32, rounds
        once); bit-identical on every rank. Returns `tensor`."""
        if tensor.is_contiguous():
            self._handle.all_reduce_(tensor)
        else:
            flat = tensor.contiguous()
            self._handle.all_reduce_(flat)
            tensor.copy_(flat)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., world_size * n] along the last dim: rank r's input at [r*n, (r+1)*n)."""
        return self._handle.all_gather(tensor.contiguous())

    def barrier(self) -> None:
        self._handle.barrier()

    def close(self) -> None:
        """Unmaps the region on this rank (a peer still waiting on this rank raises). Idempotent."""
        self._handle.close()
