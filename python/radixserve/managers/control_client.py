"""The TokenizerManager's side of the control plane: one coroutine per control request, shared by
the HTTP routes and the Engine. Each sends its message to the scheduler and awaits the reply of
its type (TokenizerManager._control); the scheduler decides when it takes effect
(scheduler/control_plane.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any

from radixserve.managers import io_struct as io
from radixserve.managers.input_validation import InvalidRequestError

if TYPE_CHECKING:
    from radixserve.managers.tokenizer_manager import TokenizerManager

# A weight update waits for in-flight requests to finish (or for a trainer's broadcast); memory
# resume reloads the checkpoint: these may take long, unlike a query.
LONG_CONTROL_TIMEOUT_S = 1800.0


class ControlClient:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm

    async def _ask(self, msg: Any, out_type: type, long: bool = False) -> Any:  # noqa: ANN401
        self.tm._raise_if_dead()
        timeout = LONG_CONTROL_TIMEOUT_S if long else None
        replies = await self.tm._control(msg, out_type, timeout)  # one per data-parallel replica
        # Every replica applied the request; a replica that refused it speaks for all of them.
        failed = [r for r in replies if getattr(r, "success", True) is False]
        return failed[0] if failed else replies[0]

    # ------------------------------------------------------------------ sessions
    async def open_session(self, obj: io.OpenSessionReqInput) -> str:
        if obj.session_id is None:
            obj = io.OpenSessionReqInput(obj.capacity_of_str_len, uuid.uuid4().hex)
        out = await self._ask(obj, io.OpenSessionReqOutput)
        if not out.success:
            raise InvalidRequestError(out.message or "Failed to open the session.")
        return out.session_id

    async def close_session(self, obj: io.CloseSessionReqInput) -> io.CloseSessionReqOutput:
        return await self._ask(obj, io.CloseSessionReqOutput)

    # ------------------------------------------------------------------ weights
    def _note_version(self, out: Any) -> None:  # noqa: ANN401
        if out.success and out.weight_version is not None:
            self.tm.weight_version = out.weight_version

    async def update_weights_from_disk(
        self, obj: io.UpdateWeightFromDiskReqInput
    ) -> io.UpdateWeightFromDiskReqOutput:
        out = await self._ask(obj, io.UpdateWeightFromDiskReqOutput, long=True)
        self._note_version(out)
        if out.success:
            self.tm.model_path = obj.model_path
        return out

    async def update_weights_from_tensor(
        self, obj: io.UpdateWeightsFromTensorReqInput
    ) -> io.UpdateWeightsFromTensorReqOutput:
        out = await self._ask(obj, io.UpdateWeightsFromTensorReqOutput, long=True)
        self._note_version(out)
        return out

    async def init_weights_update_group(
        self, obj: io.InitWeightsUpdateGroupReqInput
    ) -> io.InitWeightsUpdateGroupReqOutput:
        return await self._ask(obj, io.InitWeightsUpdateGroupReqOutput, long=True)

    async def update_weights_from_distributed(
        self, obj: io.UpdateWeightsFromDistributedReqInput
    ) -> io.UpdateWeightsFromDistributedReqOutput:
        out = await self._ask(obj, io.UpdateWeightsFromDistributedReqOutput, long=True)
        self._note_version(out)
        return out

    async def destroy_weights_update_group(
        self, obj: io.DestroyWeightsUpdateGroupReqInput
    ) -> io.DestroyWeightsUpdateGroupReqOutput:
        return await self._ask(obj, io.DestroyWeightsUpdateGroupReqOutput)

    async def get_weights_by_name(self, obj: io.GetWeightsByNameReqInput) -> io.GetWeightsByNameReqOutput:
        self.tm._raise_if_dead()
        replies = await self.tm._control(obj, io.GetWeightsByNameReqOutput)
        failed = [r for r in replies if not r.success]
        if failed or len(replies) == 1:
            return failed[0] if failed else replies[0]
        # SGLang's answer with --dp-size > 1: one parameter per replica, as the replies arrive.
        return dataclasses.replace(replies[0], parameter=[r.parameter for r in replies])

    # ------------------------------------------------------------------ memory, pause
    async def release_memory_occupation(
        self, obj: io.ReleaseMemoryOccupationReqInput
    ) -> io.ReleaseMemoryOccupationReqOutput:
        return await self._ask(obj, io.ReleaseMemoryOccupationReqOutput, long=True)

    async def resume_memory_occupation(
        self, obj: io.ResumeMemoryOccupationReqInput
    ) -> io.ResumeMemoryOccupationReqOutput:
        out = await self._ask(obj, io.ResumeMemoryOccupationReqOutput, long=True)
        self._note_version(out)
        return out

    async def pause_generation(self, obj: io.PauseGenerationReqInput) -> io.PauseGenerationReqOutput:
        return await self._ask(obj, io.PauseGenerationReqOutput)

    async def continue_generation(self) -> io.ContinueGenerationReqOutput:
        return await self._ask(io.ContinueGenerationReqInput(), io.ContinueGenerationReqOutput)

    # ------------------------------------------------------------------ operators
    async def start_profile(self, obj: io.ProfileReq) -> io.ProfileReqOutput:
        return await self._ask(obj, io.ProfileReqOutput)

    async def stop_profile(self) -> io.ProfileReqOutput:
        return await self._ask(io.ProfileReq(io.ProfileReqType.STOP_PROFILE), io.ProfileReqOutput, long=True)

    async def slow_down(self, obj: io.SlowDownReqInput) -> io.SlowDownReqOutput:
        return await self._ask(obj, io.SlowDownReqOutput)

    async def freeze_gc(self) -> io.FreezeGCReqOutput:
        return await self._ask(io.FreezeGCReq(), io.FreezeGCReqOutput)

    async def set_internal_state(self, obj: io.SetInternalStateReq) -> io.SetInternalStateReqOutput:
        return await self._ask(obj, io.SetInternalStateReqOutput)


# Every reply type the TokenizerManager routes to a waiting control call.
CONTROL_OUTPUT_TYPES: tuple[type, ...] = (
    io.OpenSessionReqOutput,
    io.CloseSessionReqOutput,
    io.UpdateWeightFromDiskReqOutput,
    io.UpdateWeightsFromTensorReqOutput,
    io.InitWeightsUpdateGroupReqOutput,
    io.UpdateWeightsFromDistributedReqOutput,
    io.DestroyWeightsUpdateGroupReqOutput,
    io.GetWeightsByNameReqOutput,
    io.ReleaseMemoryOccupationReqOutput,
    io.ResumeMemoryOccupationReqOutput,
    io.PauseGenerationReqOutput,
    io.ContinueGenerationReqOutput,
    io.ProfileReqOutput,
    io.SlowDownReqOutput,
    io.FreezeGCReqOutput,
    io.SetInternalStateReqOutput,
)
