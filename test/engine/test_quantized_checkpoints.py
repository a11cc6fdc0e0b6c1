"""Pre-quantized HF checkpoints served end to end, against the fp32 model their weights mean.

Each quantized tiny checkpoint (radixserve.testing.quantized_checkpoints) comes with the fp32
checkpoint of its exact dequantization. Served int4 (GPTQ / AWQ), decode batches run linear_wq
over the integers while prefill runs the fp32 GEMM over the same dequantized weights, so the two
models compute the same function and differ only in fp32 summation order. Served W8A8
(compressed-tensors), the checkpoint must behave exactly like `--quantization w8a8_int8` of its
dequantization, which re-derives the same int8 weights and scales.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quantization import TINY_PROMPTS, compare, forced_logprobs
from wq_spy import WqDecodeSpy

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.testing.quantized_checkpoints import write_quantized_checkpoint


def _worker(path: Path, **server_args: object) -> TpModelWorker:
    # fp32 K/V on both sides: the weights are compared (`auto` stores bf16 K/V for quantized models).
    flags = {"kv_cache_dtype": "float32", **server_args}
    args = ServerArgs(model_path=str(path), max_total_tokens=4096, device="cpu", **flags).resolve()
    return TpModelWorker(args, ModelConfig.from_path(str(path)))


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """checkpoints(kind, method) -> (quantized folder, fp32 reference folder)."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(kind: str, method: str) -> tuple[Path, Path]:
        if (kind, method) not in made:
            root = tmp_path_factory.mktemp(f"{kind}_{method}")
            write_quantized_checkpoint(tiny_model_dir(kind), root / "q", root / "ref", method, group=32)
            made[kind, method] = (root / "q", root / "ref")
        return made[kind, method]

    return make


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_checkpoint_serves_the_fp32_model_it_dequantizes_to(checkpoints, kind, method, monkeypatch):
    quantized, reference = checkpoints(kind, method)
    ref, fed = forced_logprobs(_worker(reference), TINY_PROMPTS, steps=12)
    spy = WqDecodeSpy(monkeypatch)
    worker = _worker(quantized)
    assert worker.model_runner.server_args.quantization == method  # chosen by the checkpoint
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=12, forced=fed)
    # Every decode step ran the 8 decoder linears of the tiny model on the int4 form: on the fused
    # decode stack, or through linear_wq on the module forward.
    on_module = spy.module_calls.count(len(TINY_PROMPTS)) // 8
    assert spy.fused_steps + on_module == 12, (spy.fused_steps, spy.module_calls)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # The same weights on both sides: only fp32 summation order differs (dequantize-then-matmul
    # or the int4 kernel against oneDNN / the small-M fp32 kernel), ~1e-6 relative per linear.
    # Measured with the torch reference of linear_wq: agreement 1.0, every log-prob equal (0.0);
    # the bound leaves room for a compiled kernel's summation order. A wrong nibble order, zero
    # point or scale changes the model outright (log-prob differences of whole units).
    assert agreement == 1.0, (agreement, mean_diff, max_diff)
    assert max_diff < 1e-3, (agreement, mean_diff, max_diff)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compressed_tensors_w8a8_serves_as_w8a8_int8_does(checkpoints, kind):
    quantized, reference = checkpoints(kind, "w8a8")
    fp32, fed = forced_logprobs(_worker(reference), TINY_PROMPTS, steps=12)
    on_the_fly_worker = _worker(reference, quantization="w8a8_int8")
    # The checkpoint's quantization_config ignores lm_head, which therefore stays fp32, where
    # on-the-fly w8a8_int8 gives the head an int8 weight-only form: compare the decoders.
    on_the_fly_worker.model_runner.lm_head.weight_wq = None
    on_the_fly, _ = forced_logprobs(on_the_fly_worker, TINY_PROMPTS, 12, fed)
    for flag in (None, "w8a8_int8"):  # the checkpoint selects it, or SGLang's compatible flag
        worker = _worker(quantized, quantization=flag)
        runner = worker.model_runner
        assert runner.model.model.layers[0].mlp.down_proj.weight_int8 is not None
        assert runner.lm_head.weight_wq is None and runner.lm_head.weight_int8 is None
        got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=12, forced=fed)
        # Re-quantizing the dequantized weights gives back the checkpoint's int8 values and
        # scales (each row's largest |q| is 127), so the arithmetic is the same: exact.
        for step, (g, o) in enumerate(zip(got, on_the_fly)):
            assert torch.equal(g, o), (flag, step)
    agreement, mean_diff, max_diff = compare(fp32, got, fed)
    # W8A8's activation rounding against fp32: test_quantization.py's bounds and reasons.
    assert agreement >= 0.85 and mean_diff < 0.12 and max_diff < 0.5, (agreement, mean_diff, max_diff)


@pytest.mark.parametrize("method", ["gptq", "w8a8"])
def test_release_and_resume_reload_the_quantized_forms_and_updates_are_refused(checkpoints, method):
    from radixserve.model_executor.weight_sync import WeightUpdateError

    quantized, reference = checkpoints("llama", method)
    worker = _worker(quantized)
    before, fed = forced_logprobs(worker, TINY_PROMPTS, steps=4)
    weights = worker.model_runner.weights
    weights.release_weights()
    weights.resume_weights()
    layer = worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert (layer.weight_wq if method == "gptq" else layer.weight_int8) is not None
    after, _ = forced_logprobs(worker, TINY_PROMPTS, steps=4, forced=fed)
    for step, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), step
    with pytest.raises(WeightUpdateError, match="pre-quantized checkpoint .* Restart the server"):
        weights.update_from_disk(str(reference), None)


def test_startup_errors_say_what_is_wrong(checkpoints, tmp_path):
    """The launcher refuses a conflicting flag before starting anything; a checkpoint the loader
    cannot serve (here GPTQ act-order) fails the start with the loader's message."""
    import json
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from radixserve import Engine

    quantized, _ = checkpoints("llama", "gptq")
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* argument \(awq\)"):
        Engine(model_path=str(quantized), quantization="awq")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.launch_server",
            "--model-path",
            str(quantized),
            "--quantization",
            "awq",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode != 0 and "does not match the quantization method" in cli.stderr

    act_order = tmp_path / "act_order"
    shutil.copytree(quantized, act_order)
    tensors = load_file(str(act_order / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.g_idx"] = tensors["model.layers.1.self_attn.o_proj.g_idx"].flip(
        0
    )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(act_order / "model.safetensors"))
    config = json.loads((act_order / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (act_order / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=r"o_proj\.g_idx puts inputs in groups out of order"):
        Engine(model_path=str(act_order), max_total_tokens=4096, log_level="warning")
