"""The scheduler's control-plane messages (seed 002 §4.5): sessions, weight updates, memory
release, pause, profiling, live knobs, RPC. Re-exported by io_struct, where every message lives.

Names and fields are SGLang's (its io_struct), so RL frameworks that drive SGLang over HTTP or
its Engine find the same ones. Each request is a ControlReq that declares its `ordering` (when the
scheduler lets it take effect) and its `reply_type`: its own *Output message, which ControlClient
matches to waiters by type, or the shared ControlOutcome, which names the request it answers.
Every output carries `success` and a `message` saying what happened (or why nothing did). Each
*Output is defined before the request that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

DEFAULT_WEIGHT_GROUP = "weight_update_group"


class Ordering(Enum):
    """When the scheduler's ControlPlane lets a control request take effect."""

    IN_ORDER = "in_order"  # in arrival order: behind a waiting barrier, it waits too
    BYPASS = "bypass"  # at once, past a waiting barrier (queries, aborts, pause, knobs)
    # Only once no forward is in flight and no request is alive (or generation is paused): it
    # changes what a forward reads; what arrives behind it waits (except BYPASS requests).
    BARRIER = "barrier"


class ControlReq:
    """A request to the scheduler outside generation. Each subclass declares, in its class line,
    when it takes effect (`ordering`, read by scheduler/control_plane.py; default IN_ORDER), the
    message the scheduler answers with (`reply`, which ControlClient awaits; default none) and
    whether its answer may take long (`long_running`: a weight update waits for in-flight requests
    or a trainer's broadcast, a memory resume reloads the checkpoint; default no):

        class PauseGenerationReqInput(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    """

    __slots__ = ()
    ordering: ClassVar[Ordering] = Ordering.IN_ORDER
    reply_type: ClassVar[type | None] = None
    long_running: ClassVar[bool] = False

    def __init_subclass__(
        cls, ordering: Ordering | None = None, reply: type | None = None, long_running: bool = False
    ) -> None:
        # Only what a class line names: @dataclass(slots=True) rebuilds the class without them.
        super().__init_subclass__()
        if ordering is not None:
            cls.ordering = ordering
        if reply is not None:
            cls.reply_type = reply
        if long_running:
            cls.long_running = True


@dataclass(frozen=True, slots=True)
class ControlOutcome:
    """The reply of a request that says only whether it took effect and what happened. Handlers
    leave `answers` None; the scheduler sets it to the request's class name before sending, which
    is how ControlClient finds the waiter (many requests share this reply type)."""

    success: bool
    message: str
    weight_version: str | None = None  # the weights now loaded, when the request changed them
    answers: str | None = None  # a name, not the class: msgspec (like pickle) can carry it


# ---------------------------------------------------------------------------------------- sessions
@dataclass(frozen=True, slots=True)
class SessionParams:
    """`session_params` of a generate request: continue session `id` from its request `rid`."""

    id: str | None = None
    rid: str | None = None  # the finished request to continue from; None: start of the session
    offset: int | None = None  # keep only the first `offset` tokens of rid's input + output
    replace: bool | None = None  # branch: abort rid's continuations and replace them
    drop_previous_output: bool | None = None  # continue from rid's input only


@dataclass(frozen=True, slots=True)
class OpenSessionReqOutput:
    session_id: str | None
    success: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class OpenSessionReqInput(ControlReq, ordering=Ordering.BYPASS, reply=OpenSessionReqOutput):
    capacity_of_str_len: int
    session_id: str | None = None  # generated when absent


@dataclass(frozen=True, slots=True)
class CloseSessionReqInput(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    session_id: str


# ---------------------------------------------------------------------------------------- weights
@dataclass(frozen=True, slots=True)
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str
    num_paused_requests: int = 0
    weight_version: str | None = None  # the version now loaded (on success)


@dataclass(frozen=True, slots=True)
class UpdateWeightFromDiskReqInput(
    ControlReq, ordering=Ordering.BARRIER, reply=UpdateWeightFromDiskReqOutput, long_running=True
):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False  # False: in-flight requests finish on the old weights first
    flush_cache: bool = True
    weight_version: str | None = None


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromTensorReqInput(
    ControlReq, ordering=Ordering.BARRIER, reply=ControlOutcome, long_running=True
):
    """Tensors as SGLang's RL frameworks send them: one serialized payload per TP rank
    (`serialized_named_tensors[tp_rank]`), bytes or base64 text, in SGLang's
    MultiprocessingSerializer encoding or radixserve's torch.save one; `load_format` None,
    "direct" or "flattened_bucket" (model_executor/tensor_payload.py, docs/rl.md)."""

    serialized_named_tensors: list[bytes | str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(frozen=True, slots=True)
class InitWeightsUpdateGroupReqInput(ControlReq, reply=ControlOutcome, long_running=True):
    master_address: str
    master_port: int
    rank_offset: int  # this server's TP rank r joins the group as rank rank_offset + r
    world_size: int
    group_name: str = DEFAULT_WEIGHT_GROUP
    backend: str = "nccl"


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromDistributedReqInput(
    ControlReq, ordering=Ordering.BARRIER, reply=ControlOutcome, long_running=True
):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_WEIGHT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(frozen=True, slots=True)
class DestroyWeightsUpdateGroupReqInput(ControlReq, reply=ControlOutcome):
    group_name: str = DEFAULT_WEIGHT_GROUP


@dataclass(frozen=True, slots=True)
class GetWeightsByNameReqOutput:
    # The full tensor's first `truncate_size` rows: a float32 array (it crosses the sockets as
    # bytes and is written as JSON off the event loop), a float for a 0-d tensor; with
    # --dp-size > 1 the HTTP side collects one per replica in a list.
    parameter: Any
    success: bool = True
    message: str = ""


@dataclass(frozen=True, slots=True)
class GetWeightsByNameReqInput(ControlReq, ordering=Ordering.BYPASS, reply=GetWeightsByNameReqOutput):
    name: str
    truncate_size: int = 100


# The most values one /get_weights_by_name answer holds (16 MiB as float32, ~45 MB of JSON): the
# first `truncate_size` rows of a large weight (the whole embedding) would otherwise be gigabytes.
MAX_WEIGHT_REPLY_ELEMENTS = 1 << 22


def weight_reply_error(name: str, shape: tuple[int, ...], truncate_size: int) -> str | None:
    """Why the first `truncate_size` rows of weight `name` (of `shape`) are too many to answer, or
    None. The message names the largest `truncate_size` that is answered."""
    if not shape:
        return None
    row = 1
    for size in shape[1:]:
        row *= size
    num_values = min(shape[0], max(truncate_size, 0)) * row
    if num_values <= MAX_WEIGHT_REPLY_ELEMENTS:
        return None
    return (
        f"The first {min(shape[0], truncate_size)} rows of {name!r} (shape {list(shape)}) are "
        f"{num_values} values; an answer holds at most {MAX_WEIGHT_REPLY_ELEMENTS}: "
        f"ask with truncate_size <= {MAX_WEIGHT_REPLY_ELEMENTS // max(row, 1)}."
    )


# ---------------------------------------------------------------------------------------- memory
MEMORY_TAGS = ("kv_cache", "weights")


@dataclass(frozen=True, slots=True)
class ReleaseMemoryOccupationReqInput(
    ControlReq, ordering=Ordering.BARRIER, reply=ControlOutcome, long_running=True
):
    tags: list[str] | None = None  # None: every tag in MEMORY_TAGS


@dataclass(frozen=True, slots=True)
class ResumeMemoryOccupationReqInput(
    ControlReq, ordering=Ordering.BARRIER, reply=ControlOutcome, long_running=True
):
    tags: list[str] | None = None


# ---------------------------------------------------------------------------------------- pause
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True, slots=True)
class PauseGenerationReqInput(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    mode: str = "abort"


@dataclass(frozen=True, slots=True)
class ContinueGenerationReqInput(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    """Release the requests held by the pause and schedule again."""


# ---------------------------------------------------------------------------------------- operators
class ProfileReqType(Enum):
    START_PROFILE = 1
    STOP_PROFILE = 2


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")


@dataclass(frozen=True, slots=True)
class ProfileReq(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    type: ProfileReqType
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None

    @property
    def long_running(self) -> bool:  # type: ignore[override] - per message, not per class
        """Stopping writes the trace out, which may take long; starting does not."""
        return self.type == ProfileReqType.STOP_PROFILE


class ExpertDistributionReqType(Enum):
    START_RECORD = 1
    STOP_RECORD = 2
    DUMP_RECORD = 3


@dataclass(frozen=True, slots=True)
class ExpertDistributionReq(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    """Start, stop or dump the MoE routing counts (--expert-distribution-recorder-mode)."""

    action: ExpertDistributionReqType


@dataclass(frozen=True, slots=True)
class SlowDownReqInput(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    forward_sleep_time: float | None  # seconds slept before each forward; None: back to normal


@dataclass(frozen=True, slots=True)
class FreezeGCReq(ControlReq, ordering=Ordering.BYPASS, reply=ControlOutcome):
    """Move every object alive in the scheduler to the collector's permanent generation."""


@dataclass(frozen=True, slots=True)
class SetInternalStateReqOutput:
    updated: bool
    server_args: dict[str, Any]
    message: str = ""


@dataclass(frozen=True, slots=True)
class SetInternalStateReq(ControlReq, ordering=Ordering.BYPASS, reply=SetInternalStateReqOutput):
    server_args: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- dashboard
@dataclass(frozen=True, slots=True)
class GetDashboardStateReqOutput:
    """One replica's view for /dashboard/state (scheduler/dashboard_report.py): queues, pools,
    cache counters, batch counters, its recent batches, a bounded table of its live requests and
    each rank's pool."""

    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class GetDashboardStateReq(ControlReq, ordering=Ordering.BYPASS, reply=GetDashboardStateReqOutput):
    """Ask every replica for its dashboard view; sent only while someone polls the dashboard."""

    max_rows: int = 50  # live requests listed at most (the oldest first)


# ---------------------------------------------------------------------------------------- RPC
@dataclass(frozen=True, slots=True)
class RpcReqOutput:
    success: bool
    message: str
    result: Any = None


@dataclass(frozen=True, slots=True)
class RpcReqInput(ControlReq, reply=RpcReqOutput):
    """Call the scheduler's control method `method` with `parameters` (Engine.collective_rpc)."""

    method: str
    parameters: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------- LoRA
@dataclass(frozen=True, slots=True)
class LoadLoRAAdapterReqOutput:
    """SGLang's LoRAUpdateOutput: the outcome and the adapters loaded after it ({name: path})."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadLoRAAdapterReqInput(ControlReq, reply=LoadLoRAAdapterReqOutput):
    """Read the PEFT adapter at `lora_path` into host memory as `lora_name`. `lora_id` is the
    TokenizerManager's id for this load (the radix cache's namespace), new on every load, so a
    name loaded again from another path never meets the old adapter's cached KV."""

    lora_name: str
    lora_path: str
    lora_id: str
    pinned: bool = False  # SGLang's field; accepted, every adapter is evictable here


@dataclass(frozen=True, slots=True)
class UnloadLoRAAdapterReqOutput:
    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UnloadLoRAAdapterReqInput(ControlReq, reply=UnloadLoRAAdapterReqOutput):
    """Drop adapter `lora_id` (named `lora_name`). The TokenizerManager sends it once no request
    that uses the adapter is in flight (it refuses new ones first), as SGLang does."""

    lora_name: str
    lora_id: str
