"""Operators' controls of a running scheduler (seed 002 §9.2, INVENTORY §36-37): the torch
profiler (/start_profile, /stop_profile), /slow_down (a sleep before each forward), /freeze_gc
and /set_internal_state (LiveLimits).

Profiling traces the scheduler's steps with torch.profiler: every step between start and stop
(or the next `num_steps` steps) is a "scheduler_step" range holding the ops it ran, and the trace
is written as `<output_dir>/<profile_id>-TP-<tp_rank>.trace.json.gz` (Chrome / Perfetto format),
one file per rank. The overlap loop's forward thread is not traced on CPU (torch.profiler follows
the thread that started it): run the normal loop to see the forward's ops.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch

from radixserve.managers.io_struct import (
    PROFILE_ACTIVITIES,
    ControlOutcome,
    FreezeGCReq,
    ProfileReq,
    ProfileReqType,
    SetInternalStateReq,
    SetInternalStateReqOutput,
    SlowDownReqInput,
)
from radixserve.scheduler.live_limits import LiveLimits

logger = logging.getLogger(__name__)

DEFAULT_PROFILE_DIR = os.environ.get("RADIXSERVE_TORCH_PROFILER_DIR", "/tmp")


class Profiler:
    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self.profiler: Any = None
        self.output_dir = ""
        self.profile_id = ""
        self.steps_left: int | None = None
        self._step_range: Any = None

    def start(self, msg: ProfileReq) -> ControlOutcome:
        if self.profiler is not None:
            return ControlOutcome(False, "Profiling is already in progress. Call /stop_profile first.")
        activities = msg.activities or ["CPU", "GPU"]
        unknown = [a for a in activities if a not in PROFILE_ACTIVITIES]
        if unknown:
            return ControlOutcome(
                False, f"Unknown profile activities {unknown}: use {list(PROFILE_ACTIVITIES)}."
            )
        if msg.num_steps is not None and msg.num_steps < 1:
            return ControlOutcome(False, f"num_steps must be >= 1, got {msg.num_steps}.")
        output_dir = msg.output_dir or DEFAULT_PROFILE_DIR
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as exc:
            return ControlOutcome(False, f"Cannot create output_dir {output_dir!r}: {exc}")
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if "GPU" in activities and torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=kinds,
            with_stack=bool(msg.with_stack) if msg.with_stack is not None else True,
            record_shapes=bool(msg.record_shapes),
            profile_memory="MEM" in activities,
        )
        self.profiler.start()
        self.output_dir = output_dir
        self.profile_id = msg.profile_id or str(time.time())
        self.steps_left = msg.num_steps
        logger.info("Profiling started (%s, output in %s)", ", ".join(activities), output_dir)
        return ControlOutcome(True, "Start profiling.")

    def stop(self) -> ControlOutcome:
        if self.profiler is None:
            return ControlOutcome(False, "Profiling is not in progress. Call /start_profile first.")
        self._end_step()
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = os.path.join(self.output_dir, f"{self.profile_id}-TP-{self.tp_rank}.trace.json.gz")
        profiler.export_chrome_trace(path)
        logger.info("Profiling stopped; trace written to %s", path)
        return ControlOutcome(True, f"Trace written to {path}.")

    def on_step(self) -> None:
        """At each scheduler step: close the previous step's range, count down, open the next."""
        if self.profiler is None:
            return
        self._end_step()
        if self.steps_left is not None:
            if self.steps_left <= 0:
                self.stop()
                return
            self.steps_left -= 1
        self._step_range = torch.profiler.record_function("scheduler_step")
        self._step_range.__enter__()

    def _end_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None


class OperatorControls:
    def __init__(self, limits: LiveLimits, tp_rank: int) -> None:
        self.limits = limits
        self.profiler = Profiler(tp_rank)
        self.forward_sleep_time: float | None = None

    def before_forward(self) -> None:
        """Every loop calls this right before it launches a forward."""
        if self.forward_sleep_time:
            time.sleep(self.forward_sleep_time)

    def profile(self, msg: ProfileReq) -> ControlOutcome:
        if msg.type == ProfileReqType.START_PROFILE:
            return self.profiler.start(msg)
        return self.profiler.stop()

    def slow_down(self, msg: SlowDownReqInput) -> ControlOutcome:
        t = msg.forward_sleep_time
        if t is not None and not 0 <= t <= 3600:
            return ControlOutcome(False, f"forward_sleep_time must be in [0, 3600] seconds, got {t}.")
        self.forward_sleep_time = t or None
        logger.warning("Forward sleep time set to %s s", t)
        return ControlOutcome(True, f"forward_sleep_time = {t}")

    def freeze_gc(self, msg: FreezeGCReq | None = None) -> ControlOutcome:
        """Move every object alive now to the permanent generation: the collector stops scanning
        them, which shortens GC pauses of a long-running scheduler."""
        gc.collect()
        gc.freeze()
        count = gc.get_freeze_count()
        logger.info("Garbage collector frozen (%d objects)", count)
        return ControlOutcome(True, f"Froze {count} objects in the scheduler.")

    def set_internal_state(self, msg: SetInternalStateReq) -> SetInternalStateReqOutput:
        wanted = dict(msg.server_args)
        error = self.limits.update(wanted)
        if error is not None:
            return SetInternalStateReqOutput(False, self.limits.as_dict(), error)
        logger.info("Internal state updated: %s", wanted)
        return SetInternalStateReqOutput(True, self.limits.as_dict())
