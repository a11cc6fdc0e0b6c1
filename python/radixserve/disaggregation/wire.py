"""What crosses the wire between a prefill and a decode server, and the KV packing both sides use.

Every message is a multipart ZMQ message: a pickled dict (frame 0) and, for "kv", the raw KV bytes
(frame 1). The dict's "type" is one of:

  decode -> prefill: init {room, page_size, kv_cache_dtype, num_tokens}   my pages are allocated
                     abort {room, reason}                                  drop this room
                     ack {room}                                            the KV arrived
  prefill -> decode: kv {room, num_tokens, dtype, shape, first_token, ...} frame 1: K and V
                     fail {room, reason, status_code}                     this room failed
                     ping {}                                              liveness probe
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

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


def gather_kv(pool: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    """[2, num_layers, n, heads, head_dim] copy of the K and V of `slots` (contiguous, on CPU).

    Each layer's rows are selected straight into their place in one buffer: a prompt's KV is
    copied once (then moved to the host if the pool is not there), not once per stack."""
    slots = slots.to(device=pool.device, dtype=torch.int64)
    first = pool.k_buffer[0]
    out = torch.empty(
        (2, pool.num_layers, slots.numel(), *first.shape[1:]), dtype=first.dtype, device=first.device
    )
    for layer in range(pool.num_layers):
        torch.index_select(pool.k_buffer[layer], 0, slots, out=out[0, layer])
        torch.index_select(pool.v_buffer[layer], 0, slots, out=out[1, layer])
    return out.to("cpu")


def kv_to_bytes(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(torch.uint8).numpy()).cast("B")


def scatter_kv(
    pool: MHATokenToKVPool, slots: torch.Tensor, data: bytes, shape: list[int], dtype: str
) -> None:
    """Write received K and V (as made by gather_kv) into this pool's `slots`."""
    torch_dtype = getattr(torch, dtype)
    with warnings.catch_warnings():
        # A ZMQ frame is read-only and torch warns about it; this tensor is only read from, so
        # it wraps the frame as it is rather than copying the whole payload to make it writable.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        kv = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype).view(*shape)
    if kv.shape[0] != 2 or kv.shape[1] != pool.num_layers or kv.shape[2] != slots.numel():
        raise ValueError(f"KV of shape {list(kv.shape)} does not fit {slots.numel()} slots here")
    slots = slots.to(device=pool.device, dtype=torch.int64)
    for layer in range(pool.num_layers):
        pool.k_buffer[layer].index_copy_(0, slots, kv[0, layer].to(pool.device, pool.dtype))
        pool.v_buffer[layer].index_copy_(0, slots, kv[1, layer].to(pool.device, pool.dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
