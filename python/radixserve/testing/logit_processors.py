"""A custom logit processor for tests and the docs' example of an operator's module
(--custom-logit-processor-modules radixserve.testing.logit_processors)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.sampling.custom_logit_processor import CustomLogitProcessor


class OnlyTokensLogitProcessor(CustomLogitProcessor):
    """`custom_params: {"token_ids": [...]}`: only those tokens may be sampled."""

    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            allowed = (params or {}).get("token_ids")
            if allowed:
                keep = logits[row, allowed].clone()
                logits[row, :] = -float("inf")
                logits[row, allowed] = keep
        return logits


class FailingLogitProcessor(CustomLogitProcessor):
    """Raises: the scheduler must fail its requests alone and serve on."""

    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        raise RuntimeError("this processor always fails")
