"""--enable-trace's configuration: the endpoint's forms, and a clear refusal at start when
OpenTelemetry is not installed (the server runs without it when tracing is off)."""

from __future__ import annotations

import pytest

from radixserve.server_args import ServerArgs
from radixserve.utils import tracing


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("localhost:4318", "http://localhost:4318/v1/traces"),
        ("http://otel:4318", "http://otel:4318/v1/traces"),
        ("http://otel:4318/", "http://otel:4318/v1/traces"),
        ("https://otel.example/custom/path", "https://otel.example/custom/path"),
    ],
)
def test_traces_url(endpoint: str, url: str) -> None:
    assert tracing.traces_url(endpoint) == url


def test_enable_trace_without_opentelemetry_is_refused_at_start(monkeypatch) -> None:
    monkeypatch.setattr(tracing, "missing_trace_modules", lambda: ["opentelemetry.sdk"])
    with pytest.raises(ValueError, match=r"--enable-trace needs OpenTelemetry.*radixserve\[trace\]"):
        ServerArgs(model_path="/m", enable_trace=True).validate()
    with pytest.raises(RuntimeError, match=r"radixserve\[trace\]"):
        tracing.RequestTracer.from_server_args(ServerArgs(model_path="/m", enable_trace=True))
    ServerArgs(model_path="/m").validate()  # off: nothing is needed
    assert tracing.RequestTracer.from_server_args(ServerArgs(model_path="/m")) is None


def test_a_bad_endpoint_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(tracing, "missing_trace_modules", lambda: [])
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        ServerArgs(model_path="/m", enable_trace=True, otlp_traces_endpoint="http://").validate()
