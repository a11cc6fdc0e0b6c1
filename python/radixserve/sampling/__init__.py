"""Sampling parameters, their batched tensor form and logit penalties."""

from typing import Any

from radixserve.sampling.sampling_params import GREEDY_EPS, TOP_K_ALL, SamplingParams

__all__ = ["GREEDY_EPS", "TOP_K_ALL", "PenaltyState", "SamplingBatchInfo", "SamplingParams"]


def __getattr__(name: str) -> Any:
    """The tensor-side classes import torch: only where they are used, so a process that only reads
    SamplingParams (the detokenizer, through io_struct) starts without torch."""
    if name == "PenaltyState":
        from radixserve.sampling.penalties import PenaltyState

        return PenaltyState
    if name == "SamplingBatchInfo":
        from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

        return SamplingBatchInfo
    raise AttributeError(f"module 'radixserve.sampling' has no attribute {name!r}")
