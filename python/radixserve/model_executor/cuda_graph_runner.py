"""CUDA graphs for decode (issue #7): capture the model's decode forward once per batch size at
start, then replay it instead of launching every kernel from Python each step.

A graph replays exactly the kernels it captured, reading and writing the same addresses. So:
- every input lives in a static buffer sized for the largest captured batch (`GraphInputBuffers`);
  a step copies its real rows in and fills the rest of the chosen bucket with padding rows;
- the attention backend keeps its per-step metadata in fixed buffers too, rewritten by its
  `init_forward_metadata_replay_cuda_graph` hook before each replay (layers/attention/base.py);
- the output is a static tensor, sliced to the real batch size after replay.

Padding rows are harmless by construction: they read request row 0 with seq_len 1 (the first
entry of any req_to_token row is a valid slot id: the table starts zeroed and only ever holds slot
ids), and write their K/V to slot 0, the KV pool's reserved padding page that is never handed out.

Only the model forward (embeddings -> final norm) is captured; logits, logprobs, penalties and the
grammar mask run eagerly on the sliced hidden states, so a decode batch needs nothing special to
use a graph: `can_run` only checks the mode and the size.

Capture goes through a `GraphFactory`: `CudaGraphFactory` records real graphs; tests plug an eager
stand-in (radixserve/testing/eager_graph.py) that re-runs the captured function over the same
static buffers, so the bucketing, padding and slicing are checked on CPU against the plain forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.layers.attention.base import CudaGraphAttnBackend
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionBackend
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.model_executor.forward_batch import ModelWorkerBatch
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# What padding rows hold (see the module docstring for why each is safe).
PAD_REQ_POOL_IDX = 0
PAD_SEQ_LEN = 1
PAD_OUT_CACHE_LOC = 0
PAD_TOKEN_ID = 0
NUM_WARMUPS = 2  # eager runs before a capture: lazy inits (Triton autotune, cuBLAS handles) happen here


def get_batch_sizes_to_capture(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 256 and of 16 beyond, capped at max_bs; max_bs
    itself is always included so every batch size up to it has a bucket."""
    if max_bs < 1:
        return []
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [bs for bs in sizes if bs <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    """Turns a function over static buffers into something replayable."""

    def capture(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        """Warm `run` up, capture it; returns the graph and the static tensor its replays write."""
        ...


class CudaGraphFactory:
    """Real CUDA graphs. All graphs share one memory pool: capturing the largest batch first lets
    the smaller ones fit inside the memory it already reserved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # capture off the default stream, as torch requires

    def capture(self, run: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            for _ in range(NUM_WARMUPS):
                run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = run()
        torch.cuda.synchronize(self.device)
        return graph, out


class GraphModelRunner(Protocol):
    """What the graph runner needs from ModelRunner."""

    model: torch.nn.Module
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    device: torch.device


class GraphInputBuffers:
    """The static inputs every captured graph reads, [max_bs] each, on the model's device."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def full(value: int) -> torch.Tensor:
            return torch.full((max_bs,), value, dtype=torch.int64, device=device)

        self.input_ids = full(PAD_TOKEN_ID)  # [max_bs]
        self.positions = full(PAD_SEQ_LEN - 1)  # [max_bs]
        self.req_pool_indices = full(PAD_REQ_POOL_IDX)  # [max_bs]
        self.seq_lens = full(PAD_SEQ_LEN)  # [max_bs]
        self.out_cache_loc = full(PAD_OUT_CACHE_LOC)  # [max_bs]

    def load(self, fb: ForwardBatch) -> None:
        """Rows [0, bs) <- the step's device tensors (device-to-device copies: no host sync)."""
        bs = fb.batch_size
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) <- padding; a previous replay may have left real rows there."""
        if start >= end:
            return
        self.input_ids[start:end].fill_(PAD_TOKEN_ID)
        self.positions[start:end].fill_(PAD_SEQ_LEN - 1)
        self.req_pool_indices[start:end].fill_(PAD_REQ_POOL_IDX)
        self.seq_lens[start:end].fill_(PAD_SEQ_LEN)
        self.out_cache_loc[start:end].fill_(PAD_OUT_CACHE_LOC)


class CudaGraphRunner:
    """Decode graphs for the batch sizes of `get_batch_sizes_to_capture(max_bs)` (or `capture_bs`),
    captured in the constructor."""

    can_yield = False  # a replay cannot stop between layers (ModelWorkerBatch.should_yield)

    def __init__(
        self,
        model_runner: GraphModelRunner,
        max_bs: int,
        graph_factory: GraphFactory,
        capture_bs: list[int] | None = None,
    ) -> None:
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.device = model_runner.device
        self.graph_factory = graph_factory
        self.capture_bs = sorted(capture_bs) if capture_bs else get_batch_sizes_to_capture(max_bs)
        if not self.capture_bs or self.capture_bs[0] < 1:
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {self.capture_bs}")
        self.max_bs = self.capture_bs[-1]
        self.buffers = GraphInputBuffers(self.max_bs, self.device)
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.req_to_token_pool, self.token_to_kv_pool)
        self.graphs: dict[int, CapturedGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, hidden_size] static output
        self.attn_metadata: dict[int, Any] = {}
        self.capture()

    def can_run(self, batch: ModelWorkerBatch | ForwardBatch) -> bool:
        return batch.forward_mode.is_decode() and 0 < batch.batch_size <= self.max_bs

    def pick_bs(self, raw_bs: int) -> int:
        """The smallest captured batch size that holds raw_bs rows."""
        return self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]

    @torch.inference_mode()
    def capture(self) -> None:
        on_cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        start = time.perf_counter()
        # Largest first: the shared pool grows once and the smaller graphs reuse its memory.
        for bs in _progress(reversed(self.capture_bs), len(self.capture_bs)):
            self._capture_one(bs)
        used = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30 if on_cuda else 0.0
        logger.info(
            "Captured %d decode CUDA graphs (bs %s) in %.1f s, using %.2f GiB",
            len(self.capture_bs),
            _compact(self.capture_bs),
            time.perf_counter() - start,
            used,
        )

    def _capture_one(self, bs: int) -> None:
        b = self.buffers
        b.pad(0, bs)
        meta = self.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, b.req_pool_indices[:bs], b.seq_lens[:bs]
        )
        # Valid metadata for the all-padding batch, so the warm-up runs read sane indices.
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, b.req_pool_indices[:bs], b.seq_lens[:bs], [PAD_SEQ_LEN] * bs, meta
        )
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=b.input_ids[:bs],
            positions=b.positions[:bs],
            req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs],
            seq_lens_cpu=[PAD_SEQ_LEN] * bs,  # never read inside the graph: only the metadata is
            out_cache_loc=b.out_cache_loc[:bs],
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            attn_metadata=meta,
        )

        def run() -> torch.Tensor:
            return self.model(fb.input_ids, fb.positions, fb)  # [bs, hidden_size]

        graph, out = self.graph_factory.capture(run)
        self.graphs[bs], self.outputs[bs], self.attn_metadata[bs] = graph, out, meta

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's hidden states for decode batch `fb`: [fb.batch_size, hidden_size]. The
        result is a view of the graph's static output, valid until the next replay."""
        raw_bs = fb.batch_size
        bs = self.pick_bs(raw_bs)
        b = self.buffers
        b.load(fb)
        b.pad(raw_bs, bs)
        seq_lens_cpu = list(fb.seq_lens_cpu) + [PAD_SEQ_LEN] * (bs - raw_bs)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, b.req_pool_indices[:bs], b.seq_lens[:bs], seq_lens_cpu, self.attn_metadata[bs]
        )
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs]


def create_cuda_graph_runner(
    model_runner: GraphModelRunner, server_args: ServerArgs
) -> CudaGraphRunner | None:
    """The decode graph runner ModelRunner uses, or None where decode runs eagerly."""
    if model_runner.device.type != "cuda" or server_args.disable_cuda_graph:
        return None
    if (
        server_args.expert_distribution_recorder_mode is not None
        or server_args.enable_expert_distribution_metrics
    ):
        logger.info("CUDA graphs are off: the expert-distribution recorder counts in the module forward")
        return None
    backend = model_runner.attn_backend
    if not isinstance(backend, CudaGraphAttnBackend):
        logger.info(
            "CUDA graphs are off: the %s attention backend has no graph hooks; decode runs eagerly",
            server_args.attention_backend,
        )
        return None
    max_bs = min(server_args.cuda_graph_max_bs, model_runner.req_to_token_pool.size)
    if max_bs < 1:
        return None
    try:
        return CudaGraphRunner(model_runner, max_bs, CudaGraphFactory(model_runner.device))
    except Exception:
        # Graph capture is the one start-up step CI cannot exercise (no GPU there): a failure is
        # reported loudly but leaves a server that decodes eagerly rather than none at all.
        logger.exception("CUDA graph capture failed; decode runs eagerly (--disable-cuda-graph skips it)")
        return None


def _progress(items: Iterable[int], total: int) -> Iterator[int]:
    """A tqdm bar when tqdm is installed, else one log line per batch size."""
    try:
        from tqdm import tqdm
    except ImportError:
        for i, bs in enumerate(items):
            logger.info("Capturing CUDA graph %d/%d (bs=%d)", i + 1, total, bs)
            yield bs
        return
    bar = tqdm(items, total=total, desc="Capturing CUDA graphs")
    for bs in bar:
        bar.set_postfix(bs=bs)
        yield bs


def _compact(sizes: list[int]) -> str:
    return str(sizes) if len(sizes) <= 6 else f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}]"
