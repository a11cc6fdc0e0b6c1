"""Where a prefill of a (MoE) model goes, in thread CPU time, and how its expert groups split by size.

    python benchmark/profile_moe_prefill.py /tmp/bench_moe_gguf/qwen3-30b-a3b-4l-q4_0.gguf \
        --server-args '{"cpu_wq_int8_activations": true}'

Loads the model in-process (bench_moe_gguf.py writes the files), prefills --tokens random tokens
--repeats times, and prints each part's thread CPU time over all repeats (profile_moe_decode.py's
instrumentation) and the expert projections grouped by their row count. One thread by default, so
thread CPU time is the whole cost even on a shared machine; indicative only.

Each part is held against its work: the weight bytes a prefill must read (the attention
projections and routers once for all the tokens, each expert the routing picked once, the LM head
once for the last token) and its multiply-adds, as GB/s and G MAC/s at its thread CPU time. A part
far below the machine's read rate (profile_moe_decode.py --bandwidth) and at a low MAC rate is
bound by its arithmetic, not by memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import profile_moe_decode as parts
import torch

import radixserve.layers.moe.fused_moe_cpu as fused_moe_cpu
import radixserve.models.moe_decoder as moe_decoder
from radixserve.bench_one_batch import _model_config
from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.moe.layer import FusedMoE
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

BUCKETS = (8, 16, 64)  # group sizes reported: <= 8, <= 16, <= 64, larger
GROUPS: collections.Counter[str] = collections.Counter()
GROUP_S: dict[str, float] = collections.defaultdict(float)
ROUTED: list[int] = []  # per routing call (a MoE layer of one prefill): the distinct experts picked


def _bucket(rows: int) -> str:
    return next((f"<= {b} rows" for b in BUCKETS if rows <= b), f"> {BUCKETS[-1]} rows")


def instrument_groups() -> None:
    project = fused_moe_cpu._project

    def timed(x: torch.Tensor, *args: Any) -> torch.Tensor:  # noqa: ANN401
        start = time.thread_time()
        try:
            return project(x, *args)
        finally:
            GROUPS[_bucket(x.shape[0])] += 1
            GROUP_S[_bucket(x.shape[0])] += time.thread_time() - start

    fused_moe_cpu._project = timed


def instrument_routing() -> None:
    """Record how many distinct experts each routing picked: a prefill reads those experts' bytes."""
    select = moe_decoder.select_experts

    def recorded(
        router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select(router_logits, top_k, renormalize)
        ROUTED.append(int(torch.unique(ids).numel()))
        return weights, ids

    moe_decoder.select_experts = recorded


def _form_macs(form: GroupQuantWeight) -> int:
    """N x K of a form (its scales are [N, K / group_size])."""
    return form.scales.shape[0] * form.scales.shape[1] * form.group_size


def prefill_work(
    model: torch.nn.Module, lm_head: torch.nn.Module | None, tokens: int, top_k: int
) -> dict[str, tuple[float, float]]:
    """Part -> (weight bytes, multiply-adds) of one prefill of `tokens` tokens (ROUTED's mean
    distinct experts a layer for the experts' bytes)."""
    work: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    head = getattr(getattr(lm_head, "local_head", lm_head), "weight_wq", None)
    if isinstance(head, GroupQuantWeight):
        work["LM head"] = [parts._form_bytes(head), _form_macs(head)]  # the last token's row only
    moes = [m for m in model.modules() if isinstance(m, FusedMoE) and m.experts_wq is not None]
    routed = sum(ROUTED) / len(ROUTED) if ROUTED else 0.0
    for name, module in model.named_modules():
        form = getattr(module, "weight_wq", None)
        if isinstance(form, GroupQuantWeight) and name.endswith(("qkv_proj", "o_proj")):
            work["attention projections"][0] += parts._form_bytes(form)
            work["attention projections"][1] += tokens * _form_macs(form)
        if isinstance(module, moe_decoder.SparseMoeBlock):
            gate = module.gate.weight
            work["router, top-k"][0] += gate.numel() * gate.element_size()
            work["router, top-k"][1] += tokens * gate.numel()
    for moe in moes:
        hidden = (
            moe.experts_wq.w2[0].scales.shape[0]
            if moe.experts_wq.w13_panels is None
            else moe.experts_wq.w2_panels.n
        )
        work["expert products"][0] += routed * moe.experts_wq.nbytes() / len(moe.experts_wq.w13)
        work["expert products"][1] += tokens * top_k * 3 * hidden * moe.inter
    return {name: (nbytes, macs) for name, (nbytes, macs) in work.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_path")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=args.model_path,
        max_total_tokens=4 * args.tokens,
        max_running_requests=4,
        **json.loads(args.server_args),
    ).resolve()
    config = _model_config(server_args)
    worker = build_model_worker(server_args, config)
    runner = StaticBatchRunner(worker)
    instrument_groups()  # the grouped path (layers without the one-call kernel)
    instrument_routing()
    parts.instrument(worker.model_runner.model)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.repeats):
        prompt = torch.randint(100, config.vocab_size - 100, (args.tokens,), generator=gen).tolist()
        reqs = [StaticReq(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))]
        wall, cpu = time.perf_counter(), time.thread_time()
        runner.prefill(reqs)
        print(
            f"prefill {i}: thread CPU {1e3 * (time.thread_time() - cpu):.0f} ms, "
            f"wall {1e3 * (time.perf_counter() - wall):.0f} ms"
        )
        runner.release(reqs)
    cpu_s = parts.CLOCK.cpu  # each part's exclusive thread CPU seconds
    top_k = getattr(config.hf_config, "num_experts_per_tok", 0)
    work = prefill_work(worker.model_runner.model, worker.model_runner.lm_head, args.tokens, top_k)
    for name in sorted(cpu_s, key=lambda k: -cpu_s[k]):
        seconds = cpu_s[name] / args.repeats
        nbytes, macs = work.get(name, (0.0, 0.0))
        rates = (
            f"  {nbytes / 1e6:7.1f} MB {nbytes / seconds / 1e9:5.1f} GB/s  {macs / seconds / 1e9:6.1f} G MAC/s"
            if macs
            else ""
        )
        print(f"  {name:40s} {1e3 * seconds:8.1f} ms per prefill{rates}")
    if ROUTED:
        print(f"  experts routed a layer: {sum(ROUTED) / len(ROUTED):.1f} on average")
    for bucket in sorted(GROUPS):
        print(f"  expert groups {bucket}: {GROUPS[bucket]} projections, {1e3 * GROUP_S[bucket]:.1f} ms")


if __name__ == "__main__":
    main()
