"""The control rows of the scheduler's dispatcher table (seed 002 §4.5) and the RPC methods.

Each message type maps to the handler that answers it; a handler's return value (its *Output
message) goes back to the TokenizerManager. `RpcReqInput` calls one of `RPC_METHODS` by name, the
way SGLang's Engine reaches scheduler methods that have no HTTP route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import (
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    FreezeGCReq,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    RpcReqInput,
    RpcReqOutput,
    SetInternalStateReq,
    SlowDownReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Scheduler methods an RPC may call: read-only reports and the idempotent operator actions.
RPC_METHODS = ("check_memory_leak", "flush_cache", "get_internal_state", "freeze_gc", "continue_generation")


def control_handlers(s: Scheduler) -> list[tuple[type, Callable[[Any], Any]]]:
    w, c, ops = s.weight_control, s.control, s.operators
    return [
        (OpenSessionReqInput, s.sessions.open),
        (CloseSessionReqInput, s.sessions.close),
        (UpdateWeightFromDiskReqInput, w.update_from_disk),
        (UpdateWeightsFromTensorReqInput, w.update_from_tensor),
        (InitWeightsUpdateGroupReqInput, w.init_group),
        (UpdateWeightsFromDistributedReqInput, w.update_from_distributed),
        (DestroyWeightsUpdateGroupReqInput, w.destroy_group),
        (GetWeightsByNameReqInput, w.get_weights_by_name),
        (ReleaseMemoryOccupationReqInput, c.release_memory),
        (ResumeMemoryOccupationReqInput, c.resume_memory),
        (PauseGenerationReqInput, c.pause_generation),
        (ContinueGenerationReqInput, c.continue_generation),
        (ProfileReq, ops.profile),
        (SlowDownReqInput, ops.slow_down),
        (FreezeGCReq, ops.freeze_gc),
        (SetInternalStateReq, ops.set_internal_state),
        (RpcReqInput, lambda msg: handle_rpc(s, msg)),
    ]


def handle_rpc(s: Scheduler, msg: RpcReqInput) -> RpcReqOutput:
    targets: dict[str, Callable[..., Any]] = {
        "check_memory_leak": s.check_memory_leak,
        "flush_cache": lambda: s.flush_cache(),
        "get_internal_state": lambda: s.get_internal_state().internal_state,
        "freeze_gc": lambda: s.operators.freeze_gc(),
        "continue_generation": lambda: s.control.continue_generation(),
    }
    fn = targets.get(msg.method)
    if fn is None:
        return RpcReqOutput(False, f"Unknown RPC method {msg.method!r}; available: {list(RPC_METHODS)}.")
    try:
        result = fn(**(msg.parameters or {}))
    except Exception as exc:  # a wrong parameter: report it, keep the scheduler running
        logger.warning("RPC %s failed: %s", msg.method, exc)
        return RpcReqOutput(False, f"{type(exc).__name__}: {exc}")
    return RpcReqOutput(True, "", result)
