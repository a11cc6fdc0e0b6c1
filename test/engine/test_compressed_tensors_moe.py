"""compressed-tensors W8A8 int8 MoE checkpoints served end to end. The exact reference is the
checkpoint's fp32 twin (every quantized linear and expert replaced by its dequantization) served
with --quantization w8a8_int8: requantizing the twin gives back the checkpoint's integers and
scales (the min-max observer: each row's largest |q| is 127), so both run the same int8 kernels on
the same operands and must agree bit for bit, greedy tokens and log-probs alike. That the loader
takes the file's integers as they are, even where requantization would not reproduce them, is
test/unit/test_compressed_tensors_moe_load.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_moe_w8a8 import moe_layers, spy_expert_int8
from test_quantization import TINY_PROMPTS, forced_logprobs

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.testing.quantized_checkpoints import write_quantized_checkpoint

STEPS = 8


def _worker(path: Path, **server_args: object) -> TpModelWorker:
    args = ServerArgs(model_path=str(path), max_total_tokens=4096, device="cpu", **server_args).resolve()
    return TpModelWorker(args, ModelConfig.from_path(str(path)))


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """checkpoints(kind) -> (W8A8 checkpoint folder, fp32 twin folder)."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"{kind}_ct_w8a8")
            write_quantized_checkpoint(tiny_model_dir(kind), root / "q", root / "ref", "w8a8")
            made[kind] = (root / "q", root / "ref")
        return made[kind]

    return make


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_w8a8_moe_checkpoint_serves_as_w8a8_int8_serves_its_twin(checkpoints, kind, monkeypatch):
    quantized, twin = checkpoints(kind)
    twin_worker = _worker(twin, quantization="w8a8_int8")
    # The checkpoint's quantization_config ignores lm_head, which therefore stays fp32, where
    # on-the-fly w8a8_int8 gives the head an int8 weight-only form: compare the decoders.
    twin_worker.model_runner.lm_head.weight_wq = None
    want, want_tokens = forced_logprobs(twin_worker, TINY_PROMPTS, steps=STEPS)

    worker = _worker(quantized)
    assert worker.model_runner.server_args.quantization == "compressed-tensors"  # from config.json
    moes = moe_layers(worker)
    assert moes and all(m.experts_int8 is not None for m in moes)
    for mine, theirs in zip(moes, moe_layers(twin_worker)):
        assert torch.equal(mine.experts_int8.w13, theirs.experts_int8.w13)  # the premise above
        assert torch.equal(mine.experts_int8.w2_scale, theirs.experts_int8.w2_scale)
    int8_rows = spy_expert_int8(monkeypatch)
    got, got_tokens = forced_logprobs(worker, TINY_PROMPTS, steps=STEPS)
    # Every step ran the chosen experts of every MoE layer in int8 (two projections each).
    assert len(int8_rows) >= (STEPS + 1) * len(moes) * 2
    assert got_tokens == want_tokens  # greedy tokens
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), step


def test_release_and_resume_bring_back_the_checkpoints_experts(checkpoints):
    quantized, _ = checkpoints("qwen3_moe")
    worker = _worker(quantized)
    moe = moe_layers(worker)[0]
    before_w13 = moe.experts_int8.w13.clone()
    before, fed = forced_logprobs(worker, TINY_PROMPTS, steps=3)
    weights = worker.model_runner.weights
    weights.release_weights()
    assert moe.experts_int8 is None
    weights.resume_weights()
    assert torch.equal(moe.experts_int8.w13, before_w13)  # reloaded from the file, not requantized
    after, _ = forced_logprobs(worker, TINY_PROMPTS, steps=3, forced=fed)
    for step, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), step
