"""Point-to-point traffic between pipeline stages of one TP index: hidden states forward (device
group) and sampled results back from the last stage (CPU group, pickled).

Sends never wait for the receiver (isend): a stage hands its micro-batch on and starts the next
one while the next stage is still busy. The receiver knows the shape it expects (it built the same
batch), so hidden states travel without a header.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from radixserve.distributed.communication import PendingSends, recv_pyobj, send_pyobj
from radixserve.distributed.parallel_state import RankGroups
from radixserve.model_executor.forward_batch import GenerationBatchResult, PPProxyTensors


class StageLink:
    def __init__(
        self, groups: RankGroups, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.groups = groups
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        pp_rank, pp_size = groups.pp_rank, groups.layout.pp_size
        self.prev = groups.peer_in_stage(pp_rank - 1) if pp_rank > 0 else None
        self.next = groups.peer_in_stage(pp_rank + 1) if pp_rank < pp_size - 1 else None
        self.last = groups.peer_in_stage(pp_size - 1)
        self.earlier = [groups.peer_in_stage(p) for p in range(pp_size - 1)]
        self._hidden_sends = PendingSends()
        self._obj_sends = PendingSends()

    # ------------------------------------------------------------------ hidden states
    def recv_hidden(self, num_tokens: int) -> PPProxyTensors:
        assert self.prev is not None
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.prev, group=self.groups.pp_device)
        return PPProxyTensors(buf[0], buf[1])

    def send_hidden(self, proxy: PPProxyTensors) -> None:
        assert self.next is not None
        buf = torch.stack([proxy.hidden, proxy.residual])  # [2, num_tokens, hidden_size]
        self._hidden_sends.add(dist.isend(buf, dst=self.next, group=self.groups.pp_device), buf)

    # ------------------------------------------------------------------ control objects
    def send_to_next(self, obj: Any) -> None:  # noqa: ANN401 - any picklable object
        assert self.next is not None
        send_pyobj(obj, self.next, self.groups.pp_cpu, self._obj_sends)

    def recv_from_prev(self) -> Any:  # noqa: ANN401
        assert self.prev is not None
        return recv_pyobj(self.prev, self.groups.pp_cpu)

    def publish_result(self, result: GenerationBatchResult) -> GenerationBatchResult:
        """Last stage: send a sampled result (on the host) to the same TP index of every earlier
        stage, which needs its tokens to go on; returns the host copy."""
        logprobs, invalid = result.next_token_logprobs, result.invalid_rows
        host = dataclasses.replace(
            result,
            next_token_ids=result.next_token_ids.cpu(),
            next_token_logprobs=None if logprobs is None else logprobs.cpu(),
            invalid_rows=None if invalid is None else invalid.cpu(),  # every stage fails the same rows
            copy_done=None,
        )
        for dst in self.earlier:
            send_pyobj(host, dst, self.groups.pp_cpu, self._obj_sends)
        return host

    def recv_result(self) -> GenerationBatchResult:
        """Earlier stages: the next result the last stage published."""
        return recv_pyobj(self.last, self.groups.pp_cpu)

    def exchange_result(self, result: GenerationBatchResult | None) -> GenerationBatchResult:
        """Every stage ends with the last stage's result of the batch just run (no pipelining)."""
        if self.next is None:
            assert result is not None
            return self.publish_result(result)
        return self.recv_result()

    def close(self) -> None:
        self._hidden_sends.wait_all()
        self._obj_sends.wait_all()
