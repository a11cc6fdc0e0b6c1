"""A GGUF MoE's decode steps in the CPU fused decode (model_executor/cpu_decode_moe.py): each MoE
layer runs inside the one compiled call (router, softmax top-k, the experts on their stacked
panels, the shared expert and its gate) and gives the module forward's logits. Covered: Qwen2-MoE
(shared expert with its gate, top-2, no renormalisation), Qwen3-MoE (top-8 renormalised, and
top-1 not), Mixtral (top-2 renormalised) with Q4_0 / Q4_1 experts, Q8_0 elsewhere, and a
Qwen2-MoE with a dense layer among its MoE ones (Q4_1)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_cpu_decode_runner import decode_steps

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_fused
from radixserve.layers.moe import fused_moe_a8
from radixserve.model_executor.cpu_decode_moe import moe_blocks
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_loader.gguf_source import ensure_gguf_converted
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    not (cpu_fused.ENABLED and fused_moe_a8.MOE_A8_KERNEL), reason="no moe_wq_a8_packed here"
)

Q4_EXPERTS = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q4_1"}
# name: (tiny kind, file type, per-tensor types, HF config overrides)
MODELS = {
    "qwen2_moe-shared-top2": ("qwen2_moe", "Q8_0", {}, {}),
    "qwen3_moe-top8-norm": ("qwen3_moe", "Q8_0", {}, {}),
    "qwen3_moe-top1-q4_0": ("qwen3_moe", "Q4_0", {}, {"num_experts_per_tok": 1, "norm_topk_prob": False}),
    "mixtral-q4-experts": ("mixtral", "Q8_0", Q4_EXPERTS, {}),
    # A dense layer between MoE ones (the stack's dense MLP path beside its MoE blocks), Q4_1.
    "qwen2_moe-dense-layer-q4_1": ("qwen2_moe", "Q4_1", {}, {"mlp_only_layers": [1]}),
}
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 88, 61, 12, 9, 300, 45, 18]]
STEPS = 5


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch):
    root = tmp_path_factory.mktemp("decode_moe")
    monkeypatch_module.setenv("RADIXSERVE_CACHE_DIR", str(root / "cache"))
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            kind, qtype, types, overrides = MODELS[name]
            path = make_tiny_moe_gguf(root / f"{name}.gguf", kind, qtype, types, overrides=overrides)
            made[name] = ensure_gguf_converted(str(path), show_progress=False)
        return made[name]

    return get


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _worker(folder: str, fused: bool, **flags: object) -> TpModelWorker:
    args = ServerArgs(
        model_path=folder,
        max_total_tokens=4096,
        device="cpu",
        quantization="gguf",
        kv_cache_dtype="float32",
        disable_cpu_fused_decode=not fused,
        **flags,
    ).resolve()
    return TpModelWorker(args, ModelConfig.from_path(folder, dtype="float32"))


def _decode(worker: TpModelWorker) -> tuple[list[torch.Tensor], list[int]]:
    """Every step's logits (prefill, then STEPS decodes) and the batch size of each fused call."""
    return decode_steps(worker, PROMPTS, STEPS)


@pytest.mark.parametrize("name", list(MODELS))
def test_moe_decode_steps_in_the_fused_stack_match_the_module_forward(gguf_folder, name):
    folder = gguf_folder(name)
    # --cpu-wq-int8-activations: the experts serve from their stacked panels (what the stack takes).
    ref, _ = _decode(_worker(folder, fused=False, cpu_wq_int8_activations=True))
    worker = _worker(folder, fused=True, cpu_wq_int8_activations=True)
    assert worker.model_runner.cpu_decode_runner is not None
    assert moe_blocks(list(worker.model_runner.model.model.layers))
    got, fused_calls = _decode(worker)
    assert fused_calls == [len(PROMPTS)] * STEPS  # every decode step ran as one compiled call
    assert len(got) == len(ref) == STEPS + 1
    torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)  # the prefill: the module forward both
    for step, (g, r) in enumerate(zip(got, ref)):
        # The MoE block's ops are the module forward's; the bound is the dense stack's (its fused
        # norms' summation order, test_cpu_decode_runner.py).
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert torch.equal(g.argmax(-1), r.argmax(-1))


def test_experts_off_their_panels_keep_the_module_forward(gguf_folder, caplog):
    """The exact expert path (no panels: the defaults the test suite runs with) has no compiled
    counterpart: the fused decode is off for the model, and says why at debug."""
    with caplog.at_level(logging.DEBUG, logger="radixserve.model_executor.cpu_decode_runner"):
        worker = _worker(gguf_folder("qwen3_moe-top8-norm"), fused=True)
    assert worker.model_runner.cpu_decode_runner is None
    assert "int8-activation panels" in caplog.text
