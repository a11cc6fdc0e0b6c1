"""SGLang's expert-distribution recorder (layers/moe/expert_distribution.py) on a tiny random
Qwen2-MoE (top-2 of 8 experts, a dense layer between sparse ones): the counts of each forward pass
equal the top-k choices of HF transformers' routers over the same tokens, row by row (the prefill,
then one row per decode step); nothing is counted outside start..stop; the dump is SGLang's file;
refusals say what to change."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.moe.expert_distribution import DUMP_DIR_ENV
from radixserve.managers.io_struct import ExpertDistributionReq, ExpertDistributionReqType
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.expert_distribution_control import ExpertDistributionControl
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import TINY_VOCAB

NUM_NEW = 6
KIND = "qwen2_moe"


def _args(path: str, **extra: object) -> ServerArgs:
    return ServerArgs(model_path=path, max_total_tokens=2048, device="cpu", **extra)


@pytest.fixture(scope="module")
def worker(tiny_model_dir) -> TpModelWorker:
    path = tiny_model_dir(KIND)
    args = _args(path, expert_distribution_recorder_mode="stat").resolve()
    return TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))


def _hf_counts(path: str, sequences: list[list[int]]) -> torch.Tensor:
    """[num_layers, num_experts]: HF's routers' top-k choices over every token of `sequences`,
    read from its gate modules' outputs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = hf.config
    counts = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.int64)

    def hook(layer: int):  # noqa: ANN202
        def count(module: torch.nn.Module, inputs: object, out: object) -> None:
            if isinstance(out, tuple):  # transformers 5's router: (logits, scores, chosen expert ids)
                ids = out[2]
            else:  # a plain gate Linear: its logits
                ids = torch.topk(torch.softmax(out.float(), -1), config.num_experts_per_tok, -1).indices
            counts[layer] += torch.bincount(ids.flatten(), minlength=config.num_experts)

        return count

    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(hook(i))
    with torch.no_grad():
        for seq in sequences:
            hf(torch.tensor([seq]))
    return counts


def test_counts_match_hf_routers_pass_by_pass(worker, tiny_model_dir):
    recorder = worker.info.expert_recorder
    assert recorder is not None
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    runner = StaticBatchRunner(worker)
    warm = [StaticReq(prompts[0], SamplingParams(max_new_tokens=2, temperature=0.0))]
    runner.generate(warm, 2)  # before start: not counted
    runner.release(warm)
    recorder.start()
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0)) for p in prompts]
    runner.generate(reqs, NUM_NEW)
    recorder.stop()
    after = [StaticReq(prompts[1], SamplingParams(max_new_tokens=2, temperature=0.0))]
    runner.generate(after, 2)  # after stop: not counted
    rows = recorder.take()
    top_k = 2
    # One prefill pass of every prompt, then a decode pass per new token but the last.
    assert rows.shape == (NUM_NEW, 3, 8)
    assert rows[0].sum(-1).tolist() == [sum(map(len, prompts)) * top_k, 0, sum(map(len, prompts)) * top_k]
    assert all(r.sum(-1).tolist() == [3 * top_k, 0, 3 * top_k] for r in rows[1:])  # layer 1 is dense
    sequences = [p + r.output_ids[:-1] for p, r in zip(prompts, reqs)]
    assert torch.equal(rows.sum(0), _hf_counts(tiny_model_dir(KIND), sequences))
    assert recorder.take().shape[0] == 0  # a take empties the ring


def test_the_ring_keeps_the_latest_passes(tiny_model_dir):
    path = tiny_model_dir(KIND)
    args = _args(path, expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=2)
    worker = TpModelWorker(args.resolve(), ModelConfig.from_path(path, dtype="float32"))
    recorder = worker.info.expert_recorder
    recorder.start()
    reqs = [StaticReq([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=0.0))]
    StaticBatchRunner(worker).generate(reqs, 5)
    rows = recorder.take()
    assert rows.shape[0] == 2 and all(r.sum(-1).tolist() == [2, 0, 2] for r in rows)  # two decode passes


def test_dump_writes_sglangs_file(worker, tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "dumps"))
    control = ExpertDistributionControl(worker.info.expert_recorder, tp_rank=0)
    assert control.handle(ExpertDistributionReq(ExpertDistributionReqType.START_RECORD)).success
    reqs = [StaticReq([9, 10, 11, 12], SamplingParams(max_new_tokens=3, temperature=0.0))]
    StaticBatchRunner(worker).generate(reqs, 3)
    assert control.handle(ExpertDistributionReq(ExpertDistributionReqType.STOP_RECORD)).success
    out = control.handle(ExpertDistributionReq(ExpertDistributionReqType.DUMP_RECORD))
    assert out.success and out.message.startswith(str(tmp_path / "dumps" / "expert_distribution_recorder_"))
    data = torch.load(out.message, weights_only=True)
    assert set(data) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    assert data["rank"] == 0 and data["logical_count"].dtype == torch.int64
    assert data["logical_count"].shape == (3, 3, 8)
    assert data["logical_count"][:, 0].sum() == (4 + 2) * 2  # 4 prompt + 2 fed-back tokens, top-2


def test_refusals_say_what_to_change(tiny_model_dir):
    off = ExpertDistributionControl(None, tp_rank=0).handle(
        ExpertDistributionReq(ExpertDistributionReqType.START_RECORD)
    )
    assert not off.success and "--expert-distribution-recorder-mode stat" in off.message
    path = tiny_model_dir(KIND)
    with pytest.raises(ValueError, match="only 'stat'"):
        _args(path, expert_distribution_recorder_mode="per_token").validate()
    with pytest.raises(ValueError, match="--pp-size > 1"):
        _args(path, expert_distribution_recorder_mode="stat", pp_size=2).validate()
    with pytest.raises(ValueError, match="buffer-size"):
        _args(
            path, expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=0
        ).validate()
    dense = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="no MoE layer"):
        TpModelWorker(
            _args(dense, expert_distribution_recorder_mode="stat").resolve(),
            ModelConfig.from_path(dense, dtype="float32"),
        )


def test_a_yielded_pass_is_not_counted() -> None:
    """A forward that stopped between layers (StepYielded) runs again whole: its partial counts are
    dropped, so the totals count each step's routing once."""
    from radixserve.layers.moe.expert_distribution import ExpertDistributionRecorder

    recorder = ExpertDistributionRecorder(2, 4, buffer_size=8, device=torch.device("cpu"), metrics=True)
    recorder.on_select(0, torch.tensor([[0, 1]]))
    recorder.discard_pass()
    recorder.end_pass()
    assert recorder.totals().sum() == 0
    recorder.on_select(0, torch.tensor([[0, 1]]))
    recorder.on_select(1, torch.tensor([[3, 1]]))
    recorder.end_pass()
    assert recorder.totals().tolist() == [[1, 1, 0, 0], [0, 1, 0, 1]]
