"""What crosses the wire between a prefill and a decode server, and the KV packing both sides use.

Every message is a multipart ZMQ message: a pickled dict (frame 0) and, for "kv", the raw KV bytes
(frame 1). The dict's "type" is one of:

  decode -> prefill: init {room, page_size, kv_cache_dtype, num_tokens,    my pages are allocated;
                          decode_rank, decode_tp_size, heads}              send me KV heads [a, b)
                     abort {room, reason}                                  drop this room
                     ack {room}                                            the KV arrived
  prefill -> decode: kv {room, prefill_rank, heads, num_tokens, dtype,    frame 1 (when heads is
                        shape, first_token, ...}                           not empty): K and V
                     fail {room, reason, status_code}                     this room failed
                     ping {}                                              liveness probe

Every decode rank sends an init to every prefill rank of its peer and gets one kv message from
each (heads.py says which heads each carries).
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from radixserve.mem_cache.kv_dtype import index_copy_rows_
from radixserve.mem_cache.memory_pool import MHATokenToKVPool

MsgFrames = list[bytes]

# While work is pending the I/O threads wake at least this often (timeouts, liveness pings).
IO_TICK_MS = 50
PING_INTERVAL_S = 0.5


def encode(msg: dict[str, Any], payload: bytes | memoryview | None = None) -> MsgFrames:
    frames: list[Any] = [pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)]
    if payload is not None:
        frames.append(payload)
    return frames


def decode(frames: list[Any]) -> tuple[dict[str, Any], Any]:
    """(message, payload): frames are bytes, or zmq.Frames when received with copy=False (the
    payload is then returned as a memoryview of the frame, uncopied)."""
    head = frames[0].bytes if hasattr(frames[0], "bytes") else frames[0]
    # Peers are the servers of one deployment (the bootstrap port and the rank ports must not be
    # exposed to untrusted networks: docs/disaggregation.md), as for SGLang's own ZMQ messages.
    msg = pickle.loads(head)  # noqa: S301 - see above
    if len(frames) < 2:
        return msg, None
    payload = frames[1]
    return msg, (payload.buffer if hasattr(payload, "buffer") else memoryview(payload))


def gather_kv(
    pool: MHATokenToKVPool, slots: torch.Tensor, heads: tuple[int, int] | None = None
) -> torch.Tensor:
    """[2, num_layers, n, heads, head_dim] copy of the K and V of `slots` (contiguous, on CPU),
    of this pool's local KV heads [a, b) (all of them by default).

    Each layer's rows are selected straight into their place in one buffer: a prompt's KV is
    copied once (then moved to the host if the pool is not there), not once per stack."""
    slots = slots.to(device=pool.device, dtype=torch.int64)
    first = pool.k_buffer[0]
    a, b = heads if heads is not None else (0, first.shape[1])
    out = torch.empty(
        (2, pool.num_layers, slots.numel(), b - a, *first.shape[2:]), dtype=first.dtype, device=first.device
    )
    for layer in range(pool.num_layers):
        torch.index_select(pool.k_buffer[layer][:, a:b], 0, slots, out=out[0, layer])
        torch.index_select(pool.v_buffer[layer][:, a:b], 0, slots, out=out[1, layer])
    return out.to("cpu")


def kv_to_bytes(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(torch.uint8).numpy()).cast("B")


def scatter_kv(
    pool: MHATokenToKVPool,
    slots: torch.Tensor,
    data: bytes,
    shape: list[int],
    dtype: str,
    head_start: int = 0,
) -> None:
    """Write received K and V (as made by gather_kv) into this pool's `slots`, its heads into
    the local heads starting at `head_start`."""
    torch_dtype = getattr(torch, dtype)
    with warnings.catch_warnings():
        # A ZMQ frame is read-only and torch warns about it; this tensor is only read from, so
        # it wraps the frame as it is rather than copying the whole payload to make it writable.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        kv = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype).view(*shape)
    head_stop = head_start + kv.shape[3]
    if (
        kv.shape[0] != 2
        or kv.shape[1] != pool.num_layers
        or kv.shape[2] != slots.numel()
        or head_stop > pool.k_buffer[0].shape[1]
        or list(kv.shape[4:]) != list(pool.k_buffer[0].shape[2:])
    ):
        raise ValueError(
            f"KV of shape {list(kv.shape)} does not fit {slots.numel()} slots of local heads "
            f"[{head_start}, {head_stop}) here"
        )
    slots = slots.to(device=pool.device, dtype=torch.int64)
    for layer in range(pool.num_layers):
        k = pool.k_buffer[layer][:, head_start:head_stop]
        v = pool.v_buffer[layer][:, head_start:head_stop]
        index_copy_rows_(k, 0, slots, kv[0, layer].to(pool.device, pool.dtype))
        index_copy_rows_(v, 0, slots, kv[1, layer].to(pool.device, pool.dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
