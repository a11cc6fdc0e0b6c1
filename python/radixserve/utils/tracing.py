"""--enable-trace: one OpenTelemetry trace per HTTP request, exported over OTLP/HTTP.

Spans (all made in the HTTP process, which holds the exporter):

    POST /generate            the HTTP request (TraceMiddleware); a child of the client's span when
    │                         the request carries a W3C `traceparent` header, else a new trace's root
    ├── tokenize              tokenizing / templating every prompt of the call
    └── request               one per scheduler request (rid; n > 1 and batches give several)
        ├── queue_wait        the scheduler received it → its first prefill was launched
        ├── prefill           one per prefill forward (chunk index, prompt tokens computed)
        ├── decode            first decode step launched → last one processed (steps, tokens)
        └── detokenize        the scheduler sent the final output → the HTTP process got its text

The scheduler process only keeps timestamps of traced requests and sends them back with the final
output (`ReqTrace`, scheduler/req_timeline.py): no OpenTelemetry, no exporter thread and no extra
message there, and the spans of one request are built in one place. The price: the scheduler's
spans reach the collector when the request ends, not while it runs.

OpenTelemetry is an optional dependency (the `trace` extra) and is imported only when tracing is
on; with it off nothing here runs.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from radixserve.managers.io_struct import FinishAbort, FinishReason, TraceContext

if TYPE_CHECKING:
    from radixserve.managers.req_state import ReqState
    from radixserve.server_args import ServerArgs

TRACE_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
# Probes and the dashboard's polling are not traced: one trace per poll would drown the requests.
UNTRACED_PREFIXES = ("/health", "/metrics", "/dashboard", "/get_load", "/favicon")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


def missing_trace_modules() -> list[str]:
    """The OpenTelemetry modules --enable-trace needs that are not installed."""
    missing = []
    for name in TRACE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def traces_url(endpoint: str) -> str:
    """--otlp-traces-endpoint as the exporter's URL: HOST:PORT becomes http://HOST:PORT/v1/traces;
    a URL with a path is used as it is."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    if urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return url


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """The HTTP process's tracer: its own TracerProvider (the process-global one is left to the
    user), a batching OTLP/HTTP exporter, and the W3C trace-context propagator."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": "radixserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("radixserve")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> RequestTracer | None:
        """None unless --enable-trace; a clear error when the trace extra is not installed."""
        if not args.enable_trace:
            return None
        missing = missing_trace_modules()
        if missing:
            raise RuntimeError(
                f"--enable-trace needs OpenTelemetry ({', '.join(missing)} not installed): "
                "pip install 'radixserve[trace]'"
            )
        return cls(args.otlp_traces_endpoint)

    @contextmanager
    def http_span(self, scope: Scope) -> Iterator[Any]:
        """The HTTP request's span, current while the request is served (a child of the
        client's span when a `traceparent` header came with it)."""
        from opentelemetry.trace import SpanKind

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self.propagator.extract(headers)
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path}
        with self.tracer.start_as_current_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    def span(self, name: str) -> AbstractContextManager[Any]:
        """A child of the current span (tokenize)."""
        return self.tracer.start_as_current_span(name)

    def start_request(self, rid: str) -> RequestSpan:
        return RequestSpan(self.tracer, self.tracer.start_span("request", attributes={"rid": rid}))

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter."""
        self.provider.shutdown()


def tokenize_span(tracer: RequestTracer | None) -> AbstractContextManager[Any]:
    return nullcontext() if tracer is None else tracer.span("tokenize")


class RequestSpan:
    """One scheduler request's span; the scheduler's times become its children when it ends."""

    __slots__ = ("tracer", "span")

    def __init__(self, tracer: Any, span: Any) -> None:  # noqa: ANN401 - opentelemetry objects
        self.tracer = tracer
        self.span = span

    @property
    def context(self) -> TraceContext:
        ctx = self.span.get_span_context()
        return TraceContext(trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}")

    def finish(self, state: ReqState, reason: FinishReason) -> None:
        """End the request's span now, with the scheduler's times as its children."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        now = time.time()
        sched = state.sched_trace
        parent = trace.set_span_in_context(self.span)

        def child(name: str, start: float, end: float, **attributes: Any) -> None:
            span = self.tracer.start_span(name, context=parent, start_time=_ns(start), attributes=attributes)
            span.end(end_time=_ns(max(end, start)))

        if sched is not None:
            child("queue_wait", sched.arrived, sched.first_scheduled or sched.sent)
            for i, (start, end, num_tokens) in enumerate(sched.chunks):
                child("prefill", start, end, chunk=i, num_tokens=num_tokens)
            if sched.decode_start is not None:
                end = sched.decode_end or sched.sent
                child(
                    "decode",
                    sched.decode_start,
                    end,
                    num_steps=sched.num_decode_steps,
                    num_tokens=state.completion_tokens,
                )
            child("detokenize", sched.sent, now)
        self.span.set_attributes(
            {
                "prompt_tokens": state.prompt_tokens or len(state.input_ids),
                "completion_tokens": state.completion_tokens,
                "cached_tokens": state.cached_tokens,
                "finish_reason": reason.to_json()["type"],
            }
        )
        if isinstance(reason, FinishAbort):
            self.span.set_status(Status(StatusCode.ERROR, reason.message))
        self.span.end(end_time=_ns(now))


class TraceMiddleware:
    """ASGI middleware: every HTTP request but probes and polls runs inside its span."""

    def __init__(self, app: ASGIApp, tracer: RequestTracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith(UNTRACED_PREFIXES):
            await self.app(scope, receive, send)
            return
        with self.tracer.http_span(scope) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_traced)
