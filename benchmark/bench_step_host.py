"""The host work around each decode step: a step's wall time less its model forward and LM head.

    python benchmark/bench_step_host.py                     # built-in model, one request
    python benchmark/bench_step_host.py --batch-size 16
    python benchmark/bench_step_host.py --server-args '{"model_path": "/path/to/model"}'

Builds the scheduler in this process (the model, its pools, the loop the server runs: no HTTP,
no tokenizer manager), runs --rounds requests of --output-len greedy tokens each at --batch-size,
and times every decode step's `Loop.step`. The model's part (the fused CPU decode stack or the
module forward, and the LM head) is timed by wrappers around those calls, so the rest is what the
scheduler, the batch's preparation, the sampler and result processing cost: on a CPU that work
runs right after the forward has streamed the weights through the caches, where a small torch op
costs several times its warm cost (docs/cpu_backend.md, "Host work around a step"). Each step's
outgoing message is pickled as the server's send would. Prints medians in ms; the host part is
the number to compare between builds (the model's part moves with the machine's bandwidth).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.build import build_loop
from radixserve.scheduler.scheduler_process import build_scheduler
from radixserve.server_args import ServerArgs


class ModelClock:
    """Wall seconds spent inside the wrapped calls since the last take()."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - whatever the call returns
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - tic

        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def instrument(runner: Any, clock: ModelClock) -> None:  # noqa: ANN401 - a ModelRunner
    """Time the model's forward (fused decode stack, else the module) and the LM head."""
    if runner.cpu_decode_runner is not None:
        runner.cpu_decode_runner.replay = clock.wrap(runner.cpu_decode_runner.replay)
    runner.model.forward = clock.wrap(runner.model.forward)
    runner._logits = clock.wrap(runner._logits)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--server-args", default="{}", help="ServerArgs fields as JSON (default: the built-in model)"
    )
    args = parser.parse_args()

    server_args = ServerArgs(**json.loads(args.server_args)).resolve()
    scheduler, _ = build_scheduler(server_args, lambda msg: pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
    loop = build_loop(scheduler)
    clock = ModelClock()
    instrument(scheduler.worker.model_runner, clock)

    steps: list[tuple[float, float]] = []  # (step wall s, model s) of full decode steps
    for r in range(args.rounds + 1):  # the first round warms up
        reqs = []
        for i in range(args.batch_size):
            params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            params.normalize()
            prompt = [(r * 7919 + i * 131 + j) % 1000 + 10 for j in range(args.input_len)]
            reqs.append(TokenizedGenerateReqInput(f"r{r}-{i}", "", prompt, params, stream=True))
        loop.step(reqs)
        clock.take()
        while not scheduler.is_idle():
            tic = time.perf_counter()
            loop.step([])
            wall = time.perf_counter() - tic
            batch = scheduler.state.last_batch
            model = clock.take()
            full = batch is not None and batch.forward_mode.is_decode() and len(batch.reqs) == args.batch_size
            if r > 0 and full:
                steps.append((wall, model))
    loop.close()
    walls = [w for w, _ in steps]
    models = [m for _, m in steps]
    hosts = [w - m for w, m in steps]
    print(
        f"{len(steps)} decode steps of {args.batch_size} request(s): step {statistics.median(walls) * 1e3:.3f} ms, "
        f"model forward + LM head {statistics.median(models) * 1e3:.3f} ms, "
        f"host {statistics.median(hosts) * 1e3:.3f} ms (median; mean {statistics.mean(hosts) * 1e3:.3f})"
    )


if __name__ == "__main__":
    main()
