"""Sampling parameters, their batched tensor form and logit penalties."""

from radixserve.sampling.penalties import PenaltyState
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import GREEDY_EPS, TOP_K_ALL, SamplingParams

__all__ = ["GREEDY_EPS", "TOP_K_ALL", "PenaltyState", "SamplingBatchInfo", "SamplingParams"]
