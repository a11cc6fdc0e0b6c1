"""Decode CUDA graphs (model_executor/cuda_graph_runner.py).

On CPU the graph factory is the eager stand-in (radixserve/testing/eager_graph.py): "replay"
re-runs the captured function over the same static buffers, so bucketing, padding, the Triton
backend's capture/replay hooks (in the Triton interpreter) and output slicing are all checked
against the plain eager forward. The GPU tests capture real graphs and compare with HF.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")

from radixserve.configs.model_config import ModelConfig  # noqa: E402
from radixserve.model_executor.cuda_graph_runner import (  # noqa: E402
    PAD_OUT_CACHE_LOC,
    PAD_REQ_POOL_IDX,
    PAD_SEQ_LEN,
    CudaGraphRunner,
    get_batch_sizes_to_capture,
)
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch  # noqa: E402
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq  # noqa: E402
from radixserve.model_executor.tp_worker import TpModelWorker  # noqa: E402
from radixserve.sampling.sampling_params import SamplingParams  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402
from radixserve.testing.eager_graph import EagerGraphFactory  # noqa: E402
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy  # noqa: E402

NUM_NEW = 5
# The CPU tests run every step in the Triton interpreter (seconds each on 2 cores): short prompts
# and two decode steps exercise the same bucketing, padding and replay as longer ones.
CPU_NUM_NEW = 3
CPU_PROMPT_LEN = 12
CAPTURE_BS = [1, 2, 4, 8]


def test_batch_sizes_to_capture():
    assert get_batch_sizes_to_capture(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert get_batch_sizes_to_capture(12) == [1, 2, 4, 8, 12]  # max_bs itself always has a bucket
    assert get_batch_sizes_to_capture(3) == [1, 2, 3]
    big = get_batch_sizes_to_capture(300)
    assert big[-4:] == [256, 272, 288, 300] and all(a < b for a, b in zip(big, big[1:]))
    assert get_batch_sizes_to_capture(0) == []


def _prompts(n: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, max_len))] for _ in range(n)]


@pytest.fixture(scope="module")
def worker(tiny_model_dir) -> TpModelWorker:
    path = tiny_model_dir("llama")
    # On a GPU machine Triton takes CUDA tensors only (no interpreter): the stand-in graphs run
    # there, with the worker's own graphs off (each test attaches its own runner).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs(
        model_path=path, max_total_tokens=2048, device=device, dtype="float32",
        attention_backend="triton", disable_cuda_graph=True,
    )  # fmt: skip
    return TpModelWorker(args.resolve(), ModelConfig.from_path(path, dtype="float32"))


@pytest.fixture(scope="module")
def captured(worker) -> tuple[CudaGraphRunner, EagerGraphFactory]:
    """An eager-stand-in graph runner over the worker's ModelRunner, captured once per module as a
    server captures its graphs once and replays them for every batch after."""
    factory = EagerGraphFactory()
    return CudaGraphRunner(worker.model_runner, 8, factory, capture_bs=CAPTURE_BS), factory


@pytest.fixture
def graphs(worker, captured):
    """Attach the captured runner to the worker's ModelRunner for one test, its replay log empty."""
    runner, factory = captured
    factory.replayed_bs.clear()
    factory.before_replay = None
    worker.model_runner.graph_runner = runner
    yield runner, factory
    worker.model_runner.graph_runner = None


def _generate(worker, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[StaticReq]:
    static = StaticBatchRunner(worker, return_logprob=True)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=num_new, temperature=0.0)) for p in prompts]
    static.generate(reqs, num_new)
    static.release(reqs)
    return reqs


def _decode_batch(bs: int) -> ModelWorkerBatch:
    one = torch.ones(bs, dtype=torch.int64)
    return ModelWorkerBatch(ForwardMode.DECODE, one, one, one, one, None)


def test_capture_and_bucketing(graphs):
    runner, factory = graphs
    assert factory.captured_bs == [8, 4, 2, 1]  # largest first: the shared pool is sized once
    assert [runner.pick_bs(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert runner.can_run(_decode_batch(8)) and not runner.can_run(_decode_batch(9))
    extend = _decode_batch(2)
    extend.forward_mode = ForwardMode.EXTEND
    assert not runner.can_run(extend)


# 5 pads to the bs-8 graph; 3 (pads to 4) and 8 (no padding) run in make test-all only
@pytest.mark.parametrize(
    "num_reqs", [pytest.param(3, marks=pytest.mark.slow), 5, pytest.param(8, marks=pytest.mark.slow)]
)
def test_padded_replay_matches_eager(worker, graphs, num_reqs):
    """Greedy tokens identical and logprobs equal (to fp32 noise) with and without the graph; the
    graph ran at the padded size for every decode step."""
    runner, factory = graphs
    prompts = _prompts(num_reqs, seed=num_reqs, max_len=CPU_PROMPT_LEN)
    with_graph = _generate(worker, prompts, CPU_NUM_NEW)
    assert factory.replayed_bs == [runner.pick_bs(num_reqs)] * (CPU_NUM_NEW - 1)
    worker.model_runner.graph_runner = None
    eager = _generate(worker, prompts, CPU_NUM_NEW)
    for g, e in zip(with_graph, eager):
        assert g.output_ids == e.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, e.output_logprobs)) < 1e-5


def test_padding_content_and_kv_writes(worker, graphs):
    """Padding rows read row 0 with seq_len 1 and write only the reserved slot 0; rows left over
    from a larger earlier batch are re-padded; real rows hold the step's inputs."""
    runner, factory = graphs
    snapshots: list[dict[str, torch.Tensor]] = []
    buf = runner.buffers

    def snapshot(bs: int) -> None:
        names = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
        snapshots.append({n: getattr(buf, n)[:bs].clone() for n in names})

    factory.before_replay = snapshot
    static = StaticBatchRunner(worker)
    reqs = [
        StaticReq(p, SamplingParams(max_new_tokens=4, temperature=0.0))
        for p in _prompts(7, seed=1, max_len=CPU_PROMPT_LEN)
    ]
    static.prefill(reqs)
    static.decode(reqs)  # bs 7 -> graph 8: leaves real data in all rows but the last
    short = reqs[:5]
    pool = worker.pools.token_to_kv_pool
    k_before = pool.get_key_buffer(0).clone()
    result = static.decode(short)  # bs 5 -> graph 8: rows 5..7 must be padding again
    k_after = pool.get_key_buffer(0)

    snap = snapshots[-1]
    pad = slice(5, 8)
    assert (snap["req_pool_indices"][pad] == PAD_REQ_POOL_IDX).all()
    assert (snap["seq_lens"][pad] == PAD_SEQ_LEN).all()
    assert (snap["positions"][pad] == PAD_SEQ_LEN - 1).all()
    assert (snap["out_cache_loc"][pad] == PAD_OUT_CACHE_LOC).all()
    assert snap["req_pool_indices"][:5].tolist() == [r.req_pool_idx for r in short]
    assert snap["seq_lens"][:5].tolist() == [r.seq_len - 1 for r in short]  # before this step's token
    assert snap["input_ids"][:5].tolist() == [r.output_ids[-2] for r in short]
    assert result.next_token_ids.shape == (5,)
    changed = set((k_after != k_before).flatten(1).any(1).nonzero().flatten().tolist())
    assert changed <= set(snap["out_cache_loc"][:5].tolist()) | {PAD_OUT_CACHE_LOC}
    static.release(reqs)


# ---------------------------------------------------------------------- GPU: real graphs


def _cuda_worker(path: str, disable_cuda_graph: bool) -> TpModelWorker:
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        disable_cuda_graph=disable_cuda_graph,
        cuda_graph_max_bs=16,
    )
    return TpModelWorker(args.resolve(), ModelConfig.from_path(path, dtype="float32"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The MoE kinds run the Triton experts (layers/moe/fused_moe_triton.py) inside the graphs.
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_cuda_graphs_greedy_matches_hf(tiny_model_dir, kind):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(kind)
    prompts = _prompts(5, seed=7)  # bs 5 replays the bs-8 graph: padding is exercised
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = [hf_greedy(hf, p, NUM_NEW)[0] for p in prompts]
    outputs = {}
    for disable in (True, False):
        worker = _cuda_worker(path, disable)
        assert (worker.model_runner.graph_runner is None) == disable
        outputs[disable] = [r.output_ids for r in _generate(worker, prompts)]
        del worker
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True] == reference
