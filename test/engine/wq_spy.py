"""Which path decode steps took over weight-only quantized layers: the module forward (each step
calls linear_wq once per quantized layer) or the fused CPU decode stack (one replay per step; the
runner hands every layer's wq form to DecodeModel.set_layer_wq, and test_cpu_decode_runner.py
proves the stack reads those forms)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.layers import linear as linear_module
from radixserve.model_executor.cpu_decode_runner import CpuDecodeRunner


class WqDecodeSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.module_calls: list[int] = []  # batch size of every linear_wq call on the module forward
        self.fused_steps = 0
        run = linear_module.linear_wq
        replay = CpuDecodeRunner.replay

        def linear_wq(x: Any, w: Any, b: Any = None) -> Any:
            self.module_calls.append(x.shape[0])
            return run(x, w, b)

        def fused(runner: CpuDecodeRunner, fb: Any) -> Any:
            self.fused_steps += 1
            return replay(runner, fb)

        monkeypatch.setattr(linear_module, "linear_wq", linear_wq)
        monkeypatch.setattr(CpuDecodeRunner, "replay", fused)
