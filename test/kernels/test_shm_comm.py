"""The shared-memory communicator (sgl-kernel's ShmComm, radixserve.distributed.shm_comm) on 2 and
3 spawned ranks: against gloo and against the exact rank-order sum, bit-identical on every rank,
across chunk boundaries and back-to-back calls, and failing fast (never hanging) when a peer dies,
closes, or stalls."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from shm_ranks import SMALL_SLOT, digest, pid_region_names, run_ranks

from radixserve.distributed import shm_comm
from radixserve.distributed.shm_comm import ShmCommunicator
from sgl_kernel import cpu as cpu_kernels

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernels.shm_comm_available(), reason="sgl_kernel._cpu (with ShmComm) not built"
    ),
    pytest.mark.timeout(120),
]


def _input(seed: int, rank: int, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def _rank_order_sum(seed: int, world: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """What every rank must hold: ((x0 + x1) + x2) ... in fp32, rounded once to the dtype."""
    acc = _input(seed, 0, shape, dtype).float()
    for r in range(1, world):
        acc = acc + _input(seed, r, shape, dtype).float()
    return acc.to(dtype)


def _chunks(numel: int, elem: int, slot: int) -> int:
    return -(-numel // (slot // elem))


# --- all_reduce_ --------------------------------------------------------------------------------

REDUCE_CASES = [
    ((1,), torch.float32),
    ((7,), torch.float32),
    ((1, 576), torch.float32),
    ((1023,), torch.float32),
    ((1024,), torch.float32),  # exactly one slot
    ((1025,), torch.float32),
    ((16, 576), torch.float32),  # 9 chunks
    ((3, 5, 7), torch.float32),
    ((1,), torch.bfloat16),
    ((2049,), torch.bfloat16),
    ((4, 1300), torch.bfloat16),
]


def _reduce_worker(comm, group, rank, world):
    digests = []
    for seed, (shape, dtype) in enumerate(REDUCE_CASES):
        x = _input(seed, rank, shape, dtype)
        seq = comm.handle.seq
        got = comm.all_reduce_(x.clone())
        assert comm.handle.seq - seq == _chunks(x.numel(), x.element_size(), SMALL_SLOT)
        assert torch.equal(got, _rank_order_sum(seed, world, shape, dtype)), (shape, dtype)
        if dtype == torch.float32:
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        digests.append(digest(got))
    # A non-contiguous view is reduced through a contiguous copy and written back in place.
    base = _input(99, rank, (6, 8))
    view = base.t()
    comm.all_reduce_(view)
    assert torch.equal(base, _rank_order_sum(99, world, (6, 8), torch.float32))
    return digests


def _large_reduce_worker(comm, group, rank, world):
    """Default slots and 2 threads: chunks big enough for the OpenMP copy and reduce."""
    shape = (3 << 20,)  # 12 MiB of fp32
    x = _input(7, rank, shape)
    seq = comm.handle.seq
    comm.all_reduce_(x)
    assert comm.handle.seq - seq == _chunks(x.numel(), 4, shm_comm.DEFAULT_SLOT_BYTES)
    assert torch.equal(x, _rank_order_sum(7, world, shape, torch.float32))
    gathered = comm.all_gather(_input(8, rank, (512, 3000)))
    assert torch.equal(gathered, torch.cat([_input(8, r, (512, 3000)) for r in range(world)], dim=-1))
    return digest(x)


def test_large_tensors_take_the_threaded_path():
    got = run_ranks(2, _large_reduce_worker, comm_kwargs={}, threads=2)
    assert got[0] == got[1]


# --- all_gather ---------------------------------------------------------------------------------

GATHER_CASES = [
    ((5,), torch.float32),
    ((1, 576), torch.float32),
    ((3, 1000), torch.float32),  # 12000 bytes: chunks end inside rows
    ((2, 3000), torch.float32),  # a row is larger than a slot
    ((2, 3, 7), torch.float32),
    ((16, 640), torch.bfloat16),
    ((4, 33), torch.int64),
    ((0, 8), torch.float32),
]


def _gather_worker(comm, group, rank, world):
    for seed, (shape, dtype) in enumerate(GATHER_CASES):
        x = _input(seed, rank, shape, dtype)
        got = comm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        assert torch.equal(got, torch.cat(parts, dim=-1)), (shape, dtype)
        n = shape[-1]
        assert torch.equal(got[..., rank * n : (rank + 1) * n], x)
    return True


# --- back to back -------------------------------------------------------------------------------


def _back_to_back_worker(comm, group, rank, world):
    """Random sizes and ops with no barrier in between; every so often one rank dawdles, so the
    others run a call ahead into the other buffer while it still reads the last one."""
    plan = random.Random(1234)  # the same plan on every rank
    dawdle = random.Random(rank)
    for step in range(400):
        numel = plan.choice([1, 3, 64, 576, plan.randint(1, 5000)])
        x = _input(step, rank, (numel,))
        if dawdle.random() < 0.05:
            time.sleep(0.001)
        if plan.random() < 0.5:
            comm.all_reduce_(x)
            assert torch.equal(x, _rank_order_sum(step, world, (numel,), torch.float32)), step
        else:
            got = comm.all_gather(x.view(1, numel))
            want = torch.cat([_input(step, r, (1, numel)) for r in range(world)], dim=-1)
            assert torch.equal(got, want), step
    return comm.handle.seq


def _collectives_worker(comm, group, rank, world):
    # One spawn for the three (starting ranks costs more than the checks).
    return (
        _reduce_worker(comm, group, rank, world),
        _gather_worker(comm, group, rank, world),
        _back_to_back_worker(comm, group, rank, world),
    )


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_gloo_and_the_rank_order_sum_bit_for_bit_on_every_rank(world):
    """all_reduce_ (fp32, bf16) is exactly the rank-order sum and within fp32 tolerance of gloo's,
    all_gather equals gloo's all_gather + cat, from 1 element to many chunks, then 400 back-to-back
    calls of random sizes; every rank ends with the same bits and the same chunk count."""
    got = run_ranks(world, _collectives_worker)
    digests = {r: got[r][0] for r in range(world)}
    seqs = {got[r][2] for r in range(world)}
    assert all(digests[r] == digests[0] for r in range(world))
    assert len(seqs) == 1


# --- failures -----------------------------------------------------------------------------------


# Long beside the stall case's 0.5 s timeout, so that rank 0 times out while rank 1 still stalls
# even when a busy machine schedules rank 0 late.
STALL_S = 5.0


def _failing_peer_worker(comm, group, rank, world, how):
    comm.barrier()
    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "closed":
            comm.close()  # and exits: the closed state is what rank 0 must report
            return None
        time.sleep(STALL_S)  # "stalled": alive, but never joins the next collective
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError) as first:
        comm.all_reduce_(torch.ones(100))
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError) as second:  # the ranks are out of step: refuse, do not wait
        comm.all_gather(torch.ones(4))
    return elapsed, str(first.value), str(second.value), os.getpid()


@pytest.mark.parametrize(
    "how,timeout_s,expect",
    [
        ("killed", 30.0, "rank 1 (pid"),
        ("closed", 30.0, "closed its communicator"),
        ("stalled", 0.5, "timed out after 0.5 s"),
    ],
)
def test_a_dead_closed_or_stalled_peer_raises_instead_of_hanging(how, timeout_s, expect):
    """rank 1 dies (SIGKILL), or closes, or stalls after a barrier; rank 0's next call raises
    within seconds: the first two long before the timeout, the stall at the timeout."""
    comm_kwargs = {"slot_bytes": SMALL_SLOT, "timeout_s": timeout_s}
    got = run_ranks(2, _failing_peer_worker, how, comm_kwargs=comm_kwargs, expect={0})
    elapsed, first, second, pid0 = got[0]
    assert expect in first
    assert "out of step" in second
    if how == "stalled":  # raised at its timeout, while the peer still stalled
        assert timeout_s <= elapsed < STALL_S, elapsed
    else:  # noticed long before the timeout
        assert elapsed < timeout_s / 2, elapsed
    if how == "killed":  # a zombie (nobody has reaped it yet) counts as dead
        assert "exited" in first
    assert pid_region_names(pid0) == []


# --- create -------------------------------------------------------------------------------------


def _create(group, rank, world, spoil):
    """ShmCommunicator.create with rank 1 unable to share (spoil), then exercised and closed."""
    host_id, env = shm_comm._host_id, os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS")
    if rank == 1 and spoil == "other_host":
        shm_comm._host_id = lambda: ("elsewhere", "another-boot")
    if rank == 1 and spoil == "not_built":
        os.environ["RADIXSERVE_DISABLE_CPU_KERNELS"] = "1"
    try:
        # "too_big": a 4 TiB region does not fit /dev/shm: reserving it fails (ENOSPC) on rank 0.
        slot_bytes = 1 << 40 if spoil == "too_big" else 1000
        made = ShmCommunicator.create(group, "create-test", slot_bytes=slot_bytes)
    finally:
        shm_comm._host_id = host_id
        if env is None:
            os.environ.pop("RADIXSERVE_DISABLE_CPU_KERNELS", None)
        else:
            os.environ["RADIXSERVE_DISABLE_CPU_KERNELS"] = env
    if made is None:
        return None
    assert made.handle.slot_bytes == 1024  # rounded up to cache lines
    assert (made.rank, made.world_size) == (rank, world)
    assert made.handle.peers_visible() and made.handle.check_peer_pids
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    names = pid_region_names(pids[0])
    made.all_reduce_(torch.ones(3))
    made.close()
    made.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        made.all_reduce_(torch.ones(3))
    return names


def _create_worker(comm, group, rank, world):
    return [_create(group, rank, world, spoil) for spoil in ("other_host", "not_built", "too_big", None)]


def test_create_agrees_on_every_rank_and_leaves_no_name_behind():
    got = run_ranks(2, _create_worker, with_comm=False)
    # One rank on another host, or without the extension, or no room for the region: both ranks
    # fall back to gloo (None), and neither waits on the other. Otherwise the region's name is gone
    # once both ranks attached.
    assert got == {0: [None, None, None, []], 1: [None, None, None, []]}
    assert not any(n.startswith("radixserve-shm-create_test") for n in os.listdir("/dev/shm"))


def test_stale_regions_of_dead_creators_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_comm, "SHM_DIR", tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"radixserve-shm-tp-{dead_pid}-0a1b2c3d"
    live = tmp_path / f"radixserve-shm-tp-{os.getpid()}-0a1b2c3d"
    other = tmp_path / "someone-else"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    shm_comm._sweep_stale_regions()
    assert not stale.exists() and live.exists() and other.exists()
