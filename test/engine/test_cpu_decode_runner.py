"""The CPU fused decode (model_executor/cpu_decode_runner.py) against the module forward it
replaces: the same logits step after step, on each tiny architecture, fp32 and fp16 weights, and
weight-only group-quantized (wq) layers."""

import logging

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_fused, group_quant
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.model_executor import cpu_decode_runner
from radixserve.model_executor.cpu_decode_batches import decoder_linears
from radixserve.model_executor.cpu_decode_runner import create_cpu_decode_runner
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
WQ_MAX_TOKENS = DEFAULTS.wq_max_tokens

pytestmark = pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")


def _decode_logits(path, fused, fp16, prompts, steps, prepare=None, kv="auto"):
    """Logits of every step (prefill, then `steps` decodes) and how many steps took the fused path.
    `prepare(worker)`, when given, changes the model's weights first; `kv`: --kv-cache-dtype."""
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cpu",
        cpu_fp16_weights=fp16,
        disable_cpu_fused_decode=not fused,
        kv_cache_dtype=kv,
    ).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    if prepare is not None:
        prepare(worker)
    assert (worker.model_runner.cpu_decode_runner is not None) == fused
    return decode_steps(worker, prompts, steps)


def decode_steps(
    worker: TpModelWorker, prompts: list[list[int]], steps: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy: the logits of every step (the prefill, then `steps` decodes) and the batch size of
    each call the fused path took (none without it)."""
    model_runner = worker.model_runner
    seen, processor, fused_calls = [], model_runner.logits_processor, []
    if model_runner.cpu_decode_runner is not None:
        replay = model_runner.cpu_decode_runner.replay
        model_runner.cpu_decode_runner.replay = lambda fb: fused_calls.append(fb.batch_size) or replay(fb)

    def record(hidden, lm_head, fb):  # noqa: ANN001, ANN202 - the LogitsProcessor's signature
        fb.argmax_only = False  # the full logits are what this compares, not a greedy head's argmax
        out = processor(hidden, lm_head, fb)
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


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "int8"])
def test_fused_decode_reads_quantized_kv_pools(tiny_model_dir, kind, kv):
    """The stack writes and reads a bf16 / fp8 / int8 pool in place (store_kv's quantization, the
    decode kernel's dequantization), as the module forward's attention backend does: the same
    logits to the fp32 test's 1e-4 (measured max difference 3e-6 on Zen 4, the fused norms'
    summation order; no stored value landed on a different code of its dtype)."""
    path = str(tiny_model_dir(kind))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(2)]
    ref, _ = _decode_logits(path, False, False, prompts, steps=6, kv=kv)
    got, fused_calls = _decode_logits(path, True, False, prompts, steps=6, kv=kv)
    assert fused_calls == [len(prompts)] * 6  # every decode step took the fused path
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_batches_past_the_bound_take_the_module_forward(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # 3 requests > the fp32 bound of 2
    _, fused_calls = _decode_logits(path, True, False, prompts, steps=2)
    assert fused_calls == []


def _quantize_rtn(w: torch.Tensor, bits: int, group: int, fp16_groups: bool = False) -> GroupQuantWeight:
    """Round to nearest per group of inputs: int4 asymmetric (min, max), as Q4_1; int8 symmetric, as
    Q8_0. `fp16_groups`: scales and offsets rounded through fp16, as a GGUF file stores them."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    narrow = (lambda t: t.half().float()) if fp16_groups else (lambda t: t)
    floor = 1e-4 if fp16_groups else 1e-8  # fp16 holds the former (and rounds the latter to 0)
    if bits == 4:
        lo = narrow(g.amin(-1))
        scales = narrow(((g.amax(-1) - lo) / 15).clamp_min(floor))
        q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).reshape(n, k)
        return GroupQuantWeight(pack_int4(q), scales.contiguous(), lo.contiguous(), group, 4)
    scales = narrow((g.abs().amax(-1) / 127).clamp_min(floor))
    q = (g / scales[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return GroupQuantWeight(q.contiguous(), scales.contiguous(), None, group, 8)


def _wq_layers(bits: int, group: int, dense_shift: float, fp16_groups: bool = False):
    """prepare(): every decoder linear gets a wq form of its weight, and its fp32 weight becomes that
    form's dequantization (+ dense_shift: a dense weight that differs tells which form a path read);
    then the derived forms and the fused runner are rebuilt, as a loader's would be."""

    def prepare(worker):
        runner = worker.model_runner
        for layer in runner.model.model.layers:
            for lin in decoder_linears(layer):
                wq = _quantize_rtn(lin.weight.detach(), bits, group, fp16_groups)
                lin.drop_derived()
                lin.weight.data.copy_(wq.dequantize() + dense_shift)
                lin.weight_wq = wq
        runner._prepare_cpu_linears()
        if runner.cpu_decode_runner is not None:
            runner.cpu_decode_runner = create_cpu_decode_runner(
                runner.model, runner.token_to_kv_pool, runner.server_args, runner.parallel
            )

    return prepare


@pytest.mark.skipif(not group_quant.WQ_KERNEL, reason="sgl_kernel._cpu built without linear_wq")
@pytest.mark.parametrize(("kind", "bits", "group"), [("llama", 4, 32), ("qwen2", 8, 32), ("qwen3", 4, 16)])
@pytest.mark.parametrize("dense_shift", [0.0, 0.05])
@pytest.mark.parametrize("fp16_groups", [False, True])
def test_fused_decode_runs_wq_layers_as_the_module_forward_does(
    tiny_model_dir, monkeypatch, kind, bits, group, dense_shift, fp16_groups
):
    path = str(tiny_model_dir(kind))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(4)]  # 4 > the fp32 bound of 2
    prepare = _wq_layers(bits, group, dense_shift, fp16_groups)
    # With GGUF-like groups the stack reads fp16 copies of them (half_groups), else the fp32 ones.
    stack_groups = []
    half_groups = cpu_decode_runner.half_groups

    def spy(scales, offsets):  # noqa: ANN001, ANN202 - half_groups' own signature
        out = half_groups(scales, offsets)
        stack_groups.append(out[0].dtype)
        return out

    monkeypatch.setattr(cpu_decode_runner, "half_groups", spy)
    ref, _ = _decode_logits(path, False, False, prompts, steps=6, prepare=prepare)
    got, fused_calls = _decode_logits(path, True, False, prompts, steps=6, prepare=prepare)
    narrowed = fp16_groups and cpu_decode_runner.KERNEL_TAKES_HALF_GROUPS
    assert stack_groups and set(stack_groups) == {torch.float16 if narrowed else torch.float32}
    assert len(prompts) <= WQ_MAX_TOKENS
    assert fused_calls == [len(prompts)] * 6  # every decode step took the fused path
    # The same linear_wq calls and attention on both paths: only the fused norms' summation order
    # differs (the fp32 test's 1e-4). With dense_shift the prefill (above WQ_MAX_TOKENS tokens) read
    # the shifted fp32 weights on both paths, and a fused step that read them too would be off by
    # far more than that.
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    if dense_shift == 0.0:
        # The wq forms dequantize to the fp32 weights: the plain fp32 model gives the same logits.
        def dense_only(worker):
            prepare(worker)
            for layer in worker.model_runner.model.modules():
                if getattr(layer, "weight_wq", None) is not None:
                    layer.weight_wq = None
            worker.model_runner.cpu_decode_runner = None

        fp32, _ = _decode_logits(path, False, False, prompts, steps=6, prepare=dense_only)
        for step, (g, r) in enumerate(zip(got, fp32)):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step} vs fp32")


def test_fused_decode_is_off_with_a_log_line_when_the_build_cannot_run_wq(
    tiny_model_dir, monkeypatch, caplog
):
    args = ServerArgs(model_path=str(tiny_model_dir("llama")), max_total_tokens=4096, device="cpu").resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(args.model_path, dtype="float32"))
    _wq_layers(8, 32, 0.0)(worker)
    runner = worker.model_runner

    class OldBuild:  # an extension built before linear_wq: its DecodeModel has no set_layer_wq
        DecodeModel = object

    monkeypatch.setattr(cpu_decode_runner.cpu_kernels, "_ext", OldBuild)
    with caplog.at_level(logging.INFO, logger=cpu_decode_runner.__name__):
        made = create_cpu_decode_runner(
            runner.model, runner.token_to_kv_pool, runner.server_args, runner.parallel
        )
    assert made is None
    assert "cannot run weight-only quantized layers" in caplog.text
