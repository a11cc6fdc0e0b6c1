"""The control rows of the scheduler's dispatcher table (seed 002 §4.5), the RPC methods and the
internal-state report.

Each message type maps to the handler that answers it; a handler's return value (its *Output
message) goes back to the TokenizerManager. `RpcReqInput` calls one of `handle_rpc`'s methods by
name, the way SGLang's Engine reaches scheduler methods that have no HTTP route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import (
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    ExpertDistributionReq,
    FreezeGCReq,
    GetDashboardStateReq,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    RpcReqInput,
    RpcReqOutput,
    SetInternalStateReq,
    SlowDownReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from radixserve.scheduler.expert_distribution_control import ExpertDistributionControl

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def control_handlers(s: Scheduler) -> list[tuple[type, Callable[[Any], Any]]]:
    w, mem, pause, ops = s.weight_control, s.memory_occupation, s.pause, s.operators
    return [
        (OpenSessionReqInput, s.sessions.open),
        (CloseSessionReqInput, s.sessions.close),
        (UpdateWeightFromDiskReqInput, w.update_from_disk),
        (UpdateWeightsFromTensorReqInput, w.update_from_tensor),
        (InitWeightsUpdateGroupReqInput, w.init_group),
        (UpdateWeightsFromDistributedReqInput, w.update_from_distributed),
        (DestroyWeightsUpdateGroupReqInput, w.destroy_group),
        (GetWeightsByNameReqInput, w.get_weights_by_name),
        (ReleaseMemoryOccupationReqInput, mem.release),
        (ResumeMemoryOccupationReqInput, mem.resume),
        (PauseGenerationReqInput, pause.pause_generation),
        (ContinueGenerationReqInput, pause.continue_generation),
        (ProfileReq, ops.profile),
        (SlowDownReqInput, ops.slow_down),
        (FreezeGCReq, ops.freeze_gc),
        (SetInternalStateReq, ops.set_internal_state),
        (RpcReqInput, lambda msg: handle_rpc(s, msg)),
        (LoadLoRAAdapterReqInput, s.lora_control.load),
        (UnloadLoRAAdapterReqInput, s.lora_control.unload),
        (GetDashboardStateReq, s.dashboard.report),
        (
            ExpertDistributionReq,
            ExpertDistributionControl(s.worker.info.expert_recorder, s.worker.info.tp_rank).handle,
        ),
    ]


def handle_rpc(s: Scheduler, msg: RpcReqInput) -> RpcReqOutput:
    # Scheduler methods an RPC may call: read-only reports and the idempotent operator actions.
    targets: dict[str, Callable[..., Any]] = {
        "check_memory_leak": s.check_memory_leak,
        "flush_cache": lambda: s.flush_cache(),
        "get_internal_state": lambda: s.get_internal_state().internal_state,
        "freeze_gc": lambda: s.operators.freeze_gc(),
        "continue_generation": lambda: s.pause.continue_generation(),
    }
    fn = targets.get(msg.method)
    if fn is None:
        return RpcReqOutput(False, f"Unknown RPC method {msg.method!r}; available: {list(targets)}.")
    try:
        result = fn(**(msg.parameters or {}))
    except Exception as exc:  # a wrong parameter: report it, keep the scheduler running
        logger.warning("RPC %s failed: %s", msg.method, exc)
        return RpcReqOutput(False, f"{type(exc).__name__}: {exc}")
    return RpcReqOutput(True, "", result)


def _expert_load(s: Scheduler) -> dict[str, Any]:
    """--enable-expert-distribution-metrics: the tokens routed to each (layer, expert) since start."""
    recorder = s.worker.info.expert_recorder
    if recorder is None or not recorder.metrics:
        return {}
    return {"expert_load": recorder.totals().tolist()}  # [num_layers][num_experts]


def internal_state(s: Scheduler) -> dict[str, Any]:
    """/get_server_info's internal_states entry: the scheduler's queues, pools and controls."""
    stats = s.output.stats
    return {
        "load": s.get_load().num_tokens,
        # Pipeline stages decode several micro-batches: the others' requests count too.
        "num_running_reqs": len(s.state.running_batch.reqs) + len(s.state.other_running_reqs),
        "num_waiting_reqs": len(s.state.waiting_queue),
        "num_grammar_queue_reqs": len(s.grammar.grammar_queue),
        "token_usage": s.mem.token_usage(),
        "available_tokens": s.mem.available_size(),
        "evictable_tokens": s.mem.evictable_size(),
        "max_total_num_tokens": s.mem.total_tokens,
        "cache_hit_tokens": stats.cache_hit_tokens,
        "cache_query_tokens": stats.cache_query_tokens,
        "cache_hit_rate": stats.cache_hit_tokens / max(stats.cache_query_tokens, 1),
        "last_gen_throughput": stats.last_gen_throughput,
        "new_token_ratio": s.state.new_token_ratio,
        "num_retracted_reqs": stats.num_retracted_reqs,
        "weight_version": s.weight_control.weight_version,
        "paused": s.pause.mode,
        "memory_released": sorted(s.memory_occupation.released),
        "forward_sleep_time": s.operators.forward_sleep_time,
        "num_sessions": len(s.sessions.sessions),
        **_tiers(s),
        **({"mm_cache": s.worker.info.mm_cache.stats()} if s.worker.info.mm_cache is not None else {}),
        **_expert_load(s),
        **s.live_limits.as_dict(),
        # Each rank's own pool (they must agree), gathered from every rank: all ranks
        # receive this request in the same step.
        "ranks": s.sync.gather(_pool_report(s)),
        **s.hooks.internal_state(),
    }


def _tiers(s: Scheduler) -> dict[str, object]:
    """HiCache's tier sizes and traffic (SGLang reports the host pool in the same entry)."""
    stats = s.mem.tree_cache.tier_stats()
    return {"hicache": stats} if stats else {}


def _pool_report(s: Scheduler) -> dict[str, object]:
    stats = s.output.stats
    return {
        "available_tokens": s.mem.available_size(),
        "evictable_tokens": s.mem.evictable_size(),
        "max_total_num_tokens": s.mem.total_tokens,
        "free_request_rows": s.mem.req_to_token_pool.available_size(),
        "memory_leak": s.mem.check_leak() if s.is_idle() else None,
        # Verify rounds, drafts, accepted drafts: every rank must have drafted and accepted alike.
        "spec_counts": [stats.spec_num_rounds, stats.spec_num_drafts, stats.spec_num_accepted],
    }
