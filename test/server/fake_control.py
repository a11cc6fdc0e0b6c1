"""The fake scheduler's control plane: enough for the HTTP routes to be exercised end to end.

Sessions open and close; /get_weights_by_name reads FAKE_WEIGHTS (value k of a weight is
k / 1000, float32) with the real size limit; every other control request is refused with
success=False, as a real scheduler refuses a bad one, so each route's refusal is exercised.
"""

from __future__ import annotations

import math

import numpy as np

from radixserve.managers import io_struct as io

# Shapes of the weights the fake holds: a large embedding and a vector.
FAKE_WEIGHTS = {"model.embed_tokens.weight": (40000, 128), "model.norm.weight": (128,)}
REFUSED = "The fake scheduler has no such control."

# Requests refused with their reply type's (success=False, message).
_REFUSED = (
    io.UpdateWeightFromDiskReqInput,
    io.UpdateWeightsFromTensorReqInput,
    io.InitWeightsUpdateGroupReqInput,
    io.UpdateWeightsFromDistributedReqInput,
    io.DestroyWeightsUpdateGroupReqInput,
    io.ReleaseMemoryOccupationReqInput,
    io.ResumeMemoryOccupationReqInput,
    io.PauseGenerationReqInput,
    io.ContinueGenerationReqInput,
    io.ProfileReq,
    io.SlowDownReqInput,
    io.FreezeGCReq,
    io.ExpertDistributionReq,
)


class FakeControl:
    def __init__(self) -> None:
        self.sessions: set[str] = set()

    def reply(self, msg: object) -> object | None:
        """The reply to control request `msg`, or None when `msg` is not one."""
        if isinstance(msg, io.OpenSessionReqInput):
            fresh = msg.session_id not in self.sessions
            self.sessions.add(msg.session_id)  # type: ignore[arg-type]
            return io.ControlOutcome(
                fresh, "" if fresh else "Session already open.", answers=type(msg).__name__
            )
        if isinstance(msg, io.CloseSessionReqInput):
            known = msg.session_id in self.sessions
            self.sessions.discard(msg.session_id)
            return io.ControlOutcome(
                known, "" if known else f"No session {msg.session_id!r}.", answers=type(msg).__name__
            )
        if isinstance(msg, io.GetWeightsByNameReqInput):
            return fake_weight(msg)
        if isinstance(msg, io.SetInternalStateReq):
            return io.SetInternalStateReqOutput(False, {}, REFUSED)
        if not isinstance(msg, _REFUSED):
            return None
        if msg.reply_type is io.ControlOutcome:  # named after its request, as the scheduler does
            return io.ControlOutcome(False, REFUSED, answers=type(msg).__name__)
        return msg.reply_type(False, REFUSED)


def fake_weight(msg: io.GetWeightsByNameReqInput) -> io.GetWeightsByNameReqOutput:
    shape = FAKE_WEIGHTS.get(msg.name)
    if shape is None:
        return io.GetWeightsByNameReqOutput(None, False, f"The model has no weight named {msg.name!r}.")
    too_large = io.weight_reply_error(msg.name, shape, msg.truncate_size)
    if too_large is not None:
        return io.GetWeightsByNameReqOutput(None, False, too_large)
    rows = min(shape[0], max(msg.truncate_size, 0))
    values = np.arange(rows * math.prod(shape[1:]), dtype=np.float32) / 1000
    return io.GetWeightsByNameReqOutput(values.reshape(rows, *shape[1:]))
