"""At TP > 1 every rank runs the speculative back-off rule (speculative/batch_gate.py) on its own
copy of the batch, and the rule weighs measured step times. Each rank's clock is its own: on a
busy core one rank measured its verify steps slower than its peer did, drafted less or not at all
while its peer verified, and the two ran different batches through the same collectives (the
failure of issue 35: request 3 of 3 diverged from one rank at token 37 of 40). Here two real gloo
ranks, one with a clock that charges verify rows 4x what its peer's does, make the same drafting
decisions because the step times are agreed (the slowest rank's), over shared memory and over
gloo; with each rank on its own clock (LocalSync, the old behaviour) the same clocks give
different decisions, so the scenario is one that needs the agreement."""

from __future__ import annotations

import pytest
import torch

from radixserve.distributed.layout import ParallelLayout
from radixserve.distributed.rank_runtime import LocalSync, RankRuntime
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.speculative.decode_step import SpeculativeDecodeStep
from radixserve.speculative.ngram_drafter import NgramConfig, NgramDrafter
from radixserve.testing.ranks import run_on_ranks
from req_factory import make_req

BS = 4
DECODE_S = 0.010  # a decode step of BS requests, on every rank's clock


def _runtime(rank: int, world: int, use_shm: bool) -> RankRuntime:
    """The rank's RankRuntime over the test world (TP = world, one stage)."""
    import torch.distributed as dist

    from radixserve.distributed.communication import TensorParallelComm
    from radixserve.distributed.model_parallel import ModelParallelism
    from radixserve.distributed.parallel_state import RankGroups
    from radixserve.distributed.shm_comm import ShmCommunicator

    layout = ParallelLayout(tp_size=world)
    g = dist.group.WORLD
    fast = ShmCommunicator.create(g, "spec_agree", slot_bytes=4096, timeout_s=30.0) if use_shm else None
    if use_shm:
        assert fast is not None, "the shared-memory communicator is not built"
    groups = RankGroups(layout, layout.rank_info(rank), g, g, g, g, g)
    return RankRuntime(groups, ModelParallelism(TensorParallelComm(rank, world, g, fast)))


def _batch() -> ScheduleBatch:
    """BS requests whose text repeats (every request has a draft), prompts' KV allocated."""
    allocator = TokenToKVPoolAllocator(1024, 1)
    rows = ReqToTokenPool(8, 256, "cpu")
    mem = KVMemory(rows, allocator, ChunkCache(rows, allocator, 1), 1)
    reqs = []
    for i in range(BS):
        prompt = [5, 6, 7, 8, 9] * 4
        req = make_req(f"r{i}", prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        req.req_pool_idx = mem.alloc_rows(1)[0]
        slots = mem.alloc_extend([0], [len(prompt)], [-1], len(prompt))
        mem.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)] = slots.to(torch.int32)
        req.kv_committed_len = len(prompt)
        req.output_ids = [5]
        reqs.append(req)
    return ScheduleBatch(reqs, mem, 32)


def _decisions(rank: int, world: int, sync_kind: str) -> list[tuple[bool, list[int]]]:
    """Each round: the rank times a decode step and verify steps of 2 and 6 drafted rows on its own
    clock (rank 1's rows cost 4x rank 0's: 0.1 vs 0.4 tokens of plain decoding per row), then
    decides a step for a fresh batch whose requests accept half their drafts. Returns (verify?,
    draft lengths) per round."""
    sync = LocalSync() if sync_kind == "local" else _runtime(rank, world, sync_kind == "shm")
    per_row_s = (0.1 if rank == 0 else 0.4) * DECODE_S / BS
    out = []
    for _ in range(4):
        batch = _batch()
        drafter = NgramDrafter(NgramConfig(8, 1, 4, 8, 10_000))
        step = SpeculativeDecodeStep(drafter, batch.mem, max_drafts=7, sync=sync)
        for _ in range(3):  # batch_gate.MIN_SAMPLES of each kind
            step.observe_step(False, BS, BS, DECODE_S)
            for drafted in (2, 6):
                step.observe_step(True, BS, BS + drafted, DECODE_S + drafted * per_row_s)
        for r in batch.reqs:
            step.drafter.draft(r, 100)  # builds req.spec
            r.spec.accepted, r.spec.rejected, r.spec.matches = 0.5, 0.5, None
        step.prepare(batch, 256)
        verify = batch.forward_mode == ForwardMode.TARGET_VERIFY
        out.append((verify, [len(d) for d in batch.spec_drafts] if verify else []))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync_kind", ["shm", "gloo"])
def test_ranks_with_different_clocks_draft_alike(sync_kind):
    """Agreed on the slowest rank's times (0.4 per row): at acceptance 1/2 a draft is worth 0.5,
    two 0.25, so every request drafts one token on both ranks."""
    rank0, rank1 = run_on_ranks(_decisions, 2, (sync_kind,))
    assert rank0 == rank1 == [(True, [1] * BS)] * 4


@pytest.mark.timeout(120)
def test_ranks_on_their_own_clocks_decide_differently():
    """The old behaviour, on the same clocks: rank 0 (rows at 0.1) drafts 3 tokens per request,
    rank 1 (rows at 0.4) one; their verify batches have 16 and 8 rows."""
    rank0, rank1 = run_on_ranks(_decisions, 2, ("local",))
    assert rank0 == [(True, [3] * BS)] * 4
    assert rank1 == [(True, [1] * BS)] * 4
