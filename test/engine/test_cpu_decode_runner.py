"""The CPU fused decode (model_executor/cpu_decode_runner.py) against the module forward it
replaces: the same logits step after step, on each tiny architecture, fp32 and fp16 weights."""

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_fused
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")


def _decode_logits(path, fused, fp16, prompts, steps):
    """Logits of every step (prefill, then `steps` decodes) and how many steps took the fused path."""
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cpu",
        cpu_fp16_weights=fp16,
        disable_cpu_fused_decode=not fused,
    ).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    model_runner = worker.model_runner
    assert (model_runner.cpu_decode_runner is not None) == fused
    seen, processor, fused_calls = [], model_runner.logits_processor, []
    if fused:
        replay = model_runner.cpu_decode_runner.replay
        model_runner.cpu_decode_runner.replay = lambda fb: fused_calls.append(fb.batch_size) or replay(fb)

    def record(*args):
        out = processor(*args)
        seen.append(out.next_token_logits.clone())
        return out

    model_runner.logits_processor = record
    runner = StaticBatchRunner(worker)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 1, temperature=0.0)) for p in prompts]
    runner.prefill(reqs)
    for _ in range(steps):
        runner.decode(reqs)
    return seen, fused_calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fp16", [False, True])
def test_fused_decode_matches_module_forward(tiny_model_dir, kind, fp16):
    path = str(tiny_model_dir(kind))
    max_bs = 16 if fp16 else 2
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(max_bs)]  # ragged lengths
    ref, _ = _decode_logits(path, False, fp16, prompts, steps=6)
    got, fused_calls = _decode_logits(path, True, fp16, prompts, steps=6)
    assert fused_calls == [max_bs] * 6  # every decode step, and no prefill, took the fused path
    assert len(got) == len(ref) == 7
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_batches_past_the_bound_take_the_module_forward(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # 3 requests > the fp32 bound of 2
    _, fused_calls = _decode_logits(path, True, False, prompts, steps=2)
    assert fused_calls == []
