"""The decode side's view of a prefill server (tcp_decode.py): its rooms, its replicas' ranks and
the links to them, and the small HTTP / message helpers the I/O thread uses."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from radixserve.disaggregation import wire
from radixserve.disaggregation.heads import HeadRange
from radixserve.disaggregation.utils import TransferStatus


@dataclass
class DRoom:
    status: TransferStatus
    peer: tuple[str, int]
    dp_rank: int | None = None  # the prefill replica asked for (disagg_prefill_dp_rank)
    group: int | None = None  # the prefill replica that holds the room, once known
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # mooncake: by prefill rank
    pieces: dict[int, tuple[dict[str, Any], memoryview | None]] = field(
        default_factory=dict
    )  # by prefill rank


@dataclass
class Link:
    """One prefill rank of a peer: our DEALER to it, its monitor, the heads we take from it."""

    dealer: zmq.Socket
    monitor: zmq.Socket
    heads: HeadRange


@dataclass
class Peer:
    key: tuple[str, int]
    rooms: set[int] = field(default_factory=set)
    # Once connected: per prefill replica (dp group), one link per TP rank.
    groups: list[list[Link]] = field(default_factory=list)
    follow_bootstrap_room: bool = True  # the prefill server places rooms by room % replicas
    problem: str | None = None  # a layout mismatch: every room on this peer fails
    pending_aborts: list[tuple[int, str, float]] = field(default_factory=list)  # sent once connected
    next_try: float = 0.0
    next_query: float = 0.0

    @property
    def connected(self) -> bool:
        return bool(self.groups)

    @property
    def links(self) -> list[Link]:
        return [link for group in self.groups for link in group]


def abort_msg(room: int, reason: str) -> wire.MsgFrames:
    """The abort message: the prefill server drops the room and fails its request with `reason`."""
    return wire.encode({"type": "abort", "room": room, "reason": reason})


def fetch_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET `url`, or POST `body` as JSON; an HTTP error status is a ValueError."""
    request = urllib.request.Request(url)
    if body is not None:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=1) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{url}: HTTP {exc.code}") from exc
