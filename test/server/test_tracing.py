"""--enable-trace end to end: a real server (tiny model) exports one trace per request to an
in-process OTLP/HTTP collector, with the spans docs/observability.md lists; a `traceparent` header
continues the client's trace, and a request without one starts its own."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import Server, start_servers, wait_until

pytest.importorskip("opentelemetry.sdk", reason="the trace extra (pip install 'radixserve[trace]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the trace extra")

from otlp_collector import OtlpCollector, SpanRecord  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHUNK = 8  # --chunked-prefill-size: the traced prompt runs in several prefill chunks


@pytest.fixture(scope="module")
def traced(tiny_llama_path: str):
    collector = OtlpCollector()
    server = Server(
        ["-m", "radixserve.launch_server", "--model-path", tiny_llama_path, "--enable-trace"]
        + ["--otlp-traces-endpoint", collector.endpoint, "--chunked-prefill-size", str(CHUNK)]
        + ["--max-total-tokens", "4096"],
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # export every 50 ms, not every 5 s
    )
    try:
        yield start_servers({"s": server})["s"], collector
    finally:
        server.stop()
        collector.stop()


def _trace_of(collector: OtlpCollector, rid: str) -> list[SpanRecord]:
    """Every span of the trace holding request `rid`, once the HTTP span it hangs under arrived.

    Spans are exported as they end, in batches: a streamed response's HTTP span ends after the
    last chunk went out, so it can reach the collector one batch after the request's own spans."""
    spans = list(collector.spans)
    mine = [s for s in spans if s.name == "request" and s.attributes.get("rid") == rid]
    if not mine or not any(s.span_id == mine[0].parent_span_id for s in spans):
        return []
    return [s for s in spans if s.trace_id == mine[0].trace_id]


def _check_request_spans(spans: list[SpanRecord], rid: str, min_chunks: int) -> SpanRecord:
    """The request span and its children; returns the HTTP span it hangs under."""
    by_id = {s.span_id: s for s in spans}
    (request,) = [s for s in spans if s.name == "request" and s.attributes["rid"] == rid]
    http = by_id[request.parent_span_id]
    assert http.name == "POST /generate" and http.attributes["http.response.status_code"] == 200
    (tokenize,) = [s for s in spans if s.name == "tokenize"]
    assert tokenize.parent_span_id == http.span_id
    children = [s for s in spans if s.parent_span_id == request.span_id]
    names = [s.name for s in sorted(children, key=lambda s: s.start_ns)]
    assert names[0] == "queue_wait" and names[-1] == "detokenize", names
    prefills = [s for s in children if s.name == "prefill"]
    assert len(prefills) >= min_chunks
    computed = request.attributes["prompt_tokens"] - request.attributes["cached_tokens"]
    assert sum(s.attributes["num_tokens"] for s in prefills) == computed
    assert [s.attributes["chunk"] for s in sorted(prefills, key=lambda s: s.start_ns)] == list(
        range(len(prefills))
    )
    (decode,) = [s for s in children if s.name == "decode"]
    assert decode.attributes["num_tokens"] == request.attributes["completion_tokens"] == 6
    for span in children:  # inside the request's span, in one clock
        assert request.start_ns <= span.start_ns <= span.end_ns <= request.end_ns
    assert request.end_ns <= http.end_ns
    return http


def test_one_trace_per_request_continuing_the_clients(traced) -> None:
    server, collector = traced
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    body = {"text": "the quick brown fox jumps over the lazy dog " * 3, "sampling_params": params}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    r = httpx.post(f"{server.url}/generate", json={**body, "rid": "traced-1"}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    body = {"text": "pack my box with five dozen liquor jugs " * 3, "sampling_params": params}  # no cache hit
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "rid": "own-2", "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())

    first = wait_until(lambda: _trace_of(collector, "traced-1"), 20, "the traced request's spans")
    assert {s.trace_id for s in first} == {CLIENT_TRACE}  # the client's trace goes on
    http = _check_request_spans(first, "traced-1", min_chunks=2)
    assert http.parent_span_id == CLIENT_SPAN  # the client's span is the parent

    second = wait_until(lambda: _trace_of(collector, "own-2"), 20, "the second request's spans")
    assert second[0].trace_id != CLIENT_TRACE
    http = _check_request_spans(second, "own-2", min_chunks=2)
    assert http.parent_span_id == ""  # a trace of its own
    # Probes are not traced.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert not [s for s in collector.spans if s.name.endswith("/health")]
