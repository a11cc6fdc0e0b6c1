"""The scheduler's side of SGLang's ExpertDistributionReq (/start_expert_distribution_record,
/stop_expert_distribution_record, /dump_expert_distribution_record): it drives the worker's
recorder (layers/moe/expert_distribution.py). Every rank runs the request; TP ranks route every
token alike, so only TP rank 0 writes the dump (pipeline stages are refused at start)."""

from __future__ import annotations

import logging

from radixserve.layers.moe.expert_distribution import ExpertDistributionRecorder, dump_to_file
from radixserve.managers.io_struct import (
    ControlOutcome,
    ExpertDistributionReq,
    ExpertDistributionReqType,
)

logger = logging.getLogger(__name__)

NOT_ENABLED = (
    "The expert-distribution recorder is off: start the server with --expert-distribution-recorder-mode stat "
    "(a mixture-of-experts model)."
)


class ExpertDistributionControl:
    def __init__(self, recorder: ExpertDistributionRecorder | None, tp_rank: int) -> None:
        self.recorder = recorder
        self.tp_rank = tp_rank

    def handle(self, msg: ExpertDistributionReq) -> ControlOutcome:
        recorder = self.recorder
        if recorder is None:
            return ControlOutcome(False, NOT_ENABLED)
        if msg.action == ExpertDistributionReqType.START_RECORD:
            recorder.start()
            logger.info("Expert distribution recording started")
            return ControlOutcome(True, "Start recording the expert distribution.")
        if msg.action == ExpertDistributionReqType.STOP_RECORD:
            recorder.stop()
            logger.info("Expert distribution recording stopped")
            return ControlOutcome(True, "Stop recording the expert distribution.")
        counts = recorder.take()
        if self.tp_rank != 0:
            return ControlOutcome(True, "")
        try:
            path = dump_to_file(counts, self.tp_rank)
        except OSError as exc:
            return ControlOutcome(False, f"Cannot write the expert distribution: {exc}")
        return ControlOutcome(True, path)
