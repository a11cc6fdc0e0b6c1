"""The one place that looks at PD, PP, speculation and overlap: it picks the loop's executor and
hooks for a built Scheduler (the table: docs/architecture.md, "The scheduler's loop").

    build_loop(scheduler).run_forever(recv)     # the process (scheduler_process.py)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixserve.disaggregation.utils import DisaggregationMode
from radixserve.scheduler.loops import Loop, LoopHooks, OverlapScheduleExecutor, SyncExecutor

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_loop(scheduler: Scheduler, has_input: Callable[[], bool] | None = None) -> Loop:
    """`has_input`: whether a message waits on this rank's own socket, without reading it (None:
    the rank has no socket of its own, or it is not known)."""
    hooks = attach_disaggregation(scheduler)
    if hooks is not None:
        scheduler.hooks = hooks  # admission and the internal state go through them too
    return Loop(scheduler, _executor(scheduler, hooks, has_input), hooks)


def _executor(
    scheduler: Scheduler, hooks: LoopHooks | None, has_input: Callable[[], bool] | None
) -> SyncExecutor:
    args = scheduler.server_args
    if args.pp_size > 1:
        return _pipeline_executor(scheduler)
    if hooks is not None or args.disable_overlap_schedule:
        if hooks is None and has_input is not None and _idle_capacity_yields(scheduler):
            from radixserve.scheduler.idle_capacity import IdleCapacityExecutor

            return IdleCapacityExecutor(scheduler, has_input)
        return SyncExecutor(scheduler)  # the PD sides run the normal loop
    return OverlapScheduleExecutor(scheduler)  # refuses speculative decoding


def _idle_capacity_yields(scheduler: Scheduler) -> bool:
    """Whether batch-class decode steps may stop between layers (scheduler/idle_capacity.py): one
    rank on CPU, no speculative decoding."""
    args = scheduler.server_args
    return args.tp_size == 1 and args.device == "cpu" and scheduler.builder.spec_step is None


def _pipeline_executor(scheduler: Scheduler) -> SyncExecutor:
    from radixserve.scheduler.pipeline_executor import PipelineExecutor

    args, link = scheduler.server_args, scheduler.worker.stage_link
    if not args.disable_overlap_schedule:
        logger.info("Pipeline stages overlap micro-batches across stages; the overlap loop is not used")
    micro = scheduler.live_limits.micro_batch_size  # LiveLimits sized it from the running cap
    logger.info(
        "Pipeline stage %d of %d: micro-batches of at most %d requests",
        link.groups.pp_rank,
        len(link.earlier) + 1,
        micro,
    )
    return PipelineExecutor(scheduler, link)


def attach_disaggregation(scheduler: Scheduler) -> LoopHooks | None:
    """The PD side for --disaggregation-mode prefill / decode (None: colocated). It gets the parts
    of the core it uses, and the scheduler hands it the requests it admits."""
    mode = DisaggregationMode(scheduler.server_args.disaggregation_mode)
    if mode == DisaggregationMode.NULL:
        return None
    from radixserve.disaggregation.common import SideParts, kv_layout

    s = scheduler
    pool, layout = s.worker.pools.token_to_kv_pool, kv_layout(s.worker, s.mem.page_size)
    parts = SideParts(
        s.server_args,
        pool,
        layout,
        s.mem,
        s.requests,
        s.output,
        s.sync,
        s.dp_rank,
        s.make_batch,
        s.live_limits,
    )
    if mode == DisaggregationMode.PREFILL:
        from radixserve.disaggregation.prefill import PrefillDisaggregation

        return PrefillDisaggregation(parts)
    from radixserve.disaggregation.decode import DecodeDisaggregation

    return DecodeDisaggregation(parts)
