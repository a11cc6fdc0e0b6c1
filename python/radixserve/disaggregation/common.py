"""What the prefill and decode sides share: the parts of the core they use, request admission,
the KV layout and the ranks' agreement on transfers."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from radixserve.constrained.grammar_backend import grammar_key
from radixserve.disaggregation import wire
from radixserve.disaggregation.heads import KVLayout, kv_head_range
from radixserve.disaggregation.utils import KVPoll, is_fake
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.scheduler.req import Req

if TYPE_CHECKING:
    from radixserve.distributed.rank_runtime import RankSync
    from radixserve.scheduler.kv_memory import KVMemory
    from radixserve.scheduler.live_limits import LiveLimits
    from radixserve.scheduler.output_processor import OutputProcessor
    from radixserve.scheduler.requests import RequestTable
    from radixserve.scheduler.schedule_batch import ScheduleBatch
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Bind addresses that mean "every interface": not an address a peer can reach.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class SideParts:
    """What a PD side uses of the scheduler's core (scheduler/build.py hands them over)."""

    args: ServerArgs
    kv_pool: Any  # the worker's KV pool (MHATokenToKVPool): the transfers read / write its pages
    layout: KVLayout
    mem: KVMemory
    requests: RequestTable  # its `state` holds the running batch the decode side merges into
    output: OutputProcessor
    sync: RankSync
    dp_rank: int
    make_batch: Callable[[list[Req]], ScheduleBatch]
    limits: LiveLimits  # read at each use: set_internal_state may change the running cap


def admission_error(msg: TokenizedGenerateReqInput, backend: str, mode: str) -> str | None:
    """Why a request cannot run on this side of a pair (None: it can)."""
    if grammar_key(msg.sampling_params) is not None:
        return (
            "Structured outputs (json_schema, regex, ebnf) are not supported with --disaggregation-mode yet."
        )
    routing = msg.routing
    if is_fake(routing.bootstrap_host, backend):
        return None
    if routing.bootstrap_room is None:
        return (
            f"This is a --disaggregation-mode {mode} server: a request needs bootstrap_room (and "
            "bootstrap_host / bootstrap_port), which a PD load balancer such as sglang-router "
            "--pd-disaggregation adds."
        )
    if mode == "decode" and not routing.bootstrap_host:
        return "A disaggregated decode server needs bootstrap_host (the prefill server's host)."
    return None


def admit_pd(
    parts: SideParts, msg: TokenizedGenerateReqInput, req: Req, enqueue: Callable[[Req], None]
) -> bool:
    """Copy the bootstrap fields, refuse what cannot run here, else validate and enqueue. A PD
    side takes every request (True), those it refuses included."""
    args, routing = parts.args, msg.routing
    req.routing = dataclasses.replace(
        routing,
        bootstrap_port=routing.bootstrap_port or args.disaggregation_bootstrap_port,
        bootstrap_room=routing.bootstrap_room if routing.bootstrap_room is not None else 0,
    )
    error = admission_error(msg, args.disaggregation_transfer_backend, args.disaggregation_mode)
    if error is not None:
        parts.requests.state.live[req.rid] = req
        parts.output.finish_now(req, error, int(HTTPStatus.BAD_REQUEST))
        return True
    parts.requests.add(req, enqueue)
    return True


def advertised_host(host: str) -> str:
    """The address peers can reach us at: the bind address, or this machine's for a wildcard."""
    if host in WILDCARD_HOSTS:
        return socket.gethostbyname(socket.gethostname())
    return host


def mark_scheduled(req: Req) -> None:
    now = time.monotonic()
    if req.times.first_scheduled is None:
        req.times.first_scheduled = now
        req.times.queue_time = now - req.times.queued


def kv_layout(worker: Any, page_size: int) -> KVLayout:  # noqa: ANN401 - the model worker
    """This rank's KV pool as the peer server must see it (its TP shard's KV heads)."""
    pool, info = worker.pools.token_to_kv_pool, worker.info
    tp_size, tp_rank = info.tp_size, info.tp_rank
    if info.num_attention_heads is None or info.num_kv_heads is None:  # a test worker: every head
        num_kv_heads, heads = pool.num_kv_heads, (0, pool.num_kv_heads)
    else:
        num_kv_heads = info.num_kv_heads
        heads = kv_head_range(info.num_attention_heads, num_kv_heads, tp_size, tp_rank)
    if heads[1] - heads[0] != pool.num_kv_heads:
        raise RuntimeError(f"the KV pool holds {pool.num_kv_heads} heads, the TP shard {heads}")
    return KVLayout(
        page_size=page_size,
        kv_cache_dtype=wire.dtype_name(pool.dtype),
        num_layers=pool.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=pool.head_dim,
        tp_size=tp_size,
        tp_rank=tp_rank,
        heads=heads,
    )


@dataclass(frozen=True)
class Agreed:
    """A transfer's status as every rank of this server sees it (the lowest: Failed wins, Success
    only once every rank's part arrived), and why it failed (from the rank that saw it)."""

    status: KVPoll
    error: str | None = None
    status_code: int | None = 503


def agree(sync: RankSync, handles: list[Any]) -> list[Agreed]:  # noqa: ANN401 - senders / receivers
    """The agreed status of each handle: one small all-reduce over the ranks (none on one rank),
    plus a gather of the reasons when some transfer failed. Every rank calls it with its own
    handles of the same requests, in the same order, so all act alike."""
    if not handles:
        return []
    local = [h.poll() for h in handles]
    statuses = [KVPoll(v) for v in sync.min_each([int(s) for s in local])]
    failed = [i for i, s in enumerate(statuses) if s == KVPoll.Failed]
    reasons: dict[int, tuple[str | None, int | None]] = {}
    if failed:
        mine = {
            i: (handles[i].status.error, handles[i].status.error_status_code)
            for i in failed
            if local[i] == KVPoll.Failed
        }
        for theirs in sync.gather(mine):
            for i, reason in theirs.items():  # type: ignore[attr-defined] - dicts, as sent
                reasons.setdefault(i, reason)
    return [Agreed(s, *reasons.get(i, (None, 503))) for i, s in enumerate(statuses)]
