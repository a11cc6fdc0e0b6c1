"""The one place that looks at PD, PP, speculation and overlap: it picks the loop's executor and
hooks for a built Scheduler (the table: docs/architecture.md, "The scheduler's loop").

    build_loop(scheduler).run_forever(recv)     # the process (scheduler_process.py)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from radixserve.disaggregation.utils import DisaggregationMode
from radixserve.scheduler.loops import Loop, LoopHooks, OverlapScheduleExecutor, SyncExecutor

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_loop(scheduler: Scheduler) -> Loop:
    hooks = attach_disaggregation(scheduler)
    return Loop(scheduler, _executor(scheduler, hooks), hooks)


def _executor(scheduler: Scheduler, hooks: LoopHooks | None) -> SyncExecutor:
    args = scheduler.server_args
    if args.pp_size > 1:
        return _pipeline_executor(scheduler)
    if hooks is not None or args.disable_overlap_schedule:
        return SyncExecutor(scheduler)  # the PD sides run the normal loop
    return OverlapScheduleExecutor(scheduler)  # refuses speculative decoding


def _pipeline_executor(scheduler: Scheduler) -> SyncExecutor:
    from radixserve.scheduler.pipeline_executor import PipelineExecutor

    args, link = scheduler.server_args, scheduler.worker.stage_link
    if not args.disable_overlap_schedule:
        logger.info("Pipeline stages overlap micro-batches across stages; the overlap loop is not used")
    pp_size = len(link.earlier) + 1
    micro = args.pp_max_micro_batch_size or max(scheduler.max_running_requests // pp_size, 1)
    # Each slot's running batch holds one micro-batch: the builder's running cap is its size.
    builder = scheduler.builder
    builder.live = dataclasses.replace(builder.live, max_running_requests=micro)
    logger.info(
        "Pipeline stage %d of %d: micro-batches of at most %d requests", link.groups.pp_rank, pp_size, micro
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
    pool, layout = s.worker.token_to_kv_pool, kv_layout(s.worker, s.mem.page_size)
    live_cap = lambda: s.max_running_requests  # noqa: E731 - set_internal_state may change it
    parts = SideParts(
        s.server_args, pool, layout, s.mem, s.requests, s.output, s.sync, s.dp_rank, s.make_batch, live_cap
    )
    if mode == DisaggregationMode.PREFILL:
        from radixserve.disaggregation.prefill import PrefillDisaggregation

        side: LoopHooks = PrefillDisaggregation(parts)
    else:
        from radixserve.disaggregation.decode import DecodeDisaggregation

        side = DecodeDisaggregation(parts)
    s.disagg = side
    return side
