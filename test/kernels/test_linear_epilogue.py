"""Linear.forward_act: the activation in oneDNN's GEMM epilogue equals the activation applied
after the linear, on every path a batch size takes."""

import pytest
import torch

from radixserve.layers.activation import ACTIVATIONS
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.linear import (
    Linear,
    onednn_prepack_available,
    prepare_cpu_linears,
)

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
F16_MAX_TOKENS = DEFAULTS.f16_max_tokens
F32_SMALL_MAX_TOKENS = DEFAULTS.f32_small_max_tokens

needs_onednn = pytest.mark.skipif(not onednn_prepack_available(), reason="torch built without oneDNN")
SIZES = [1, F32_SMALL_MAX_TOKENS, F32_SMALL_MAX_TOKENS + 1, F16_MAX_TOKENS + 1, 300]


def _layer(seed: int) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(48, 80)
    with torch.no_grad():
        layer.bias.normal_()  # make pre-activations of both signs matter
    return layer


@needs_onednn
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("fp16", [False, True])
def test_forward_act_equals_the_activation_after_the_linear(name, fp16):
    from radixserve.layers import cpu_fused

    if fp16 and not cpu_fused.ENABLED:
        pytest.skip("sgl-kernel's CPU extension is not built")
    layer, act = _layer(0), ACTIVATIONS[name]
    prepare_cpu_linears([layer], fp16=fp16, prepack=True)
    for n in SIZES:
        x = torch.randn(n, 48)
        torch.testing.assert_close(layer.forward_act(x, act), act.fn(layer(x)), atol=1e-6, rtol=1e-6)
    strided = torch.randn(40, 96)[:, :48]  # oneDNN wants dense rows: the layer copies them
    torch.testing.assert_close(layer.forward_act(strided, act), act.fn(layer(strided)), atol=1e-6, rtol=1e-6)


@needs_onednn
def test_forward_act_runs_in_the_epilogue_only_where_onednn_serves_the_batch(monkeypatch):
    layer, act = _layer(1), ACTIVATIONS["gelu"]
    calls: list[str] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, w, b, attr, scalars, algorithm):
        calls.append(attr)
        return real(x, w, b, attr, scalars, algorithm)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    layer.forward_act(torch.randn(300, 48), act)  # not prepared: F.linear, then F.gelu
    assert calls == []
    prepare_cpu_linears([layer], fp16=False, prepack=True)
    layer.forward_act(torch.randn(300, 48), act)
    assert calls == ["gelu"]  # one call, the activation fused
    calls.clear()
    layer.forward_act(torch.randn(F32_SMALL_MAX_TOKENS, 48), act)  # the small-M kernel's sizes
    assert "gelu" not in calls
