"""/dashboard and /dashboard/state in-process, with a stub TokenizerManager whose schedulers answer
canned reports: the state's shape, the API key (the static files are public, the data is not),
bounded sizes, rates and percentiles over the window, and --disable-dashboard (404 everywhere).
The real scheduler's report is test_dashboard_report.py's; the page in a browser is
test/server/test_dashboard_browser.py's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from radixserve.entrypoints.dashboard.assets import ASSETS, read_asset
from radixserve.entrypoints.dashboard.window import Counts, MetricsWindow, Snapshot, quantile
from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.managers.io_struct import GetDashboardStateReq, GetDashboardStateReqOutput
from radixserve.server_args import ServerArgs
from radixserve.utils.metrics import LATENCY_BUCKETS, ServerMetrics

KEY = "sk-dashboard-test"


def _report(dp_rank: int, tokens: int, num_rows: int) -> dict:
    return {
        "dp_rank": dp_rank,
        "time": 0.0,
        "num_running_reqs": 2,
        "num_waiting_reqs": 1,
        "num_grammar_queue_reqs": 0,
        "max_total_num_tokens": 1000,
        "used_tokens": 250,
        "available_tokens": 700,
        "evictable_tokens": 50,
        "cached_tokens": 100,
        "cache_hit_tokens": tokens // 2,
        "cache_query_tokens": tokens,
        "num_batches": tokens // 10,
        "num_prefill_tokens": tokens,
        "num_decode_tokens": 2 * tokens,
        "batches": [
            {
                "launched_at": 0.0,
                "mode": "decode",
                "num_reqs": 2,
                "num_prefill_tokens": 0,
                "num_decode_tokens": 2,
                "ms": 3.0,
            }
        ],
        "num_live_reqs": 300,
        "requests": [
            {
                "rid": f"r{i}",
                "age_s": 1.0,
                "prompt_tokens": 5,
                "output_tokens": 1,
                "cached_tokens": 0,
                "state": "decoding",
            }
            for i in range(num_rows)
        ],
        "ranks": [
            {
                "tp_rank": 0,
                "pp_rank": 0,
                "max_total_num_tokens": 1000,
                "used_tokens": 250,
                "evictable_tokens": 50,
                "mean_batch_ms": 3.0,
            }
        ],
    }


class StubControl:
    """Every replica answers GetDashboardStateReq; its counters grow by 100 tokens per call."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.asked: list[GetDashboardStateReq] = []

    async def ask_all(self, msg: object, timeout: float | None = None) -> list[GetDashboardStateReqOutput]:
        assert isinstance(msg, GetDashboardStateReq)
        self.asked.append(msg)
        tokens = 100 * len(self.asked)
        # Replies come in any order: the state lists replicas by dp_rank.
        return [
            GetDashboardStateReqOutput(_report(d, tokens, msg.max_rows))
            for d in reversed(range(self.dp_size))
        ]


class StubTokenizerManager:
    def __init__(
        self, dp_size: int = 1, api_key: str | None = None, metrics: bool = True, **args: object
    ) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny", api_key=api_key, dp_size=dp_size, **args)
        self.model_path = "/models/tiny"
        self.served_model_name = "tiny"
        self.context_len = 128
        self.is_generation = True
        self.metrics = ServerMetrics(1000 * dp_size, dp_size) if metrics else None
        self.control = StubControl(dp_size)
        self.num_in_flight = 0


def _client(tm: StubTokenizerManager, ready: bool = True) -> TestClient:
    return TestClient(create_app(ServerState(tm=tm, ready=ready)), base_url="http://localhost")  # type: ignore[arg-type]


def test_static_files_are_served_with_a_strict_policy() -> None:
    client = _client(StubTokenizerManager())
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    for path, (name, media_type) in ASSETS.items():
        resp = client.get(path)
        assert resp.status_code == 200 and resp.headers["content-type"] == media_type
        assert resp.content == read_asset(name) and resp.content
    # No CDN, no inline script: everything the page loads is one of its own files.
    html = page.text
    assert "http://" not in html and "https://" not in html and "<script>" not in html
    for name, _ in ASSETS.values():
        if name != "index.html":
            assert f'"dashboard/{name}"' in html


def test_state_shape_rates_and_latency() -> None:
    tm = StubTokenizerManager(dp_size=2)
    client = _client(tm)
    first = client.get("/dashboard/state").json()
    assert first["dp_size"] == 2 and first["model"] == "tiny" and first["metrics_enabled"] is True
    assert [r["dp_rank"] for r in first["replicas"]] == [0, 1]
    replica = first["replicas"][0]
    assert replica["kv_usage"] == 0.25 and replica["cache_usage"] == 0.1
    assert replica["prefill_tokens_per_s"] is None  # one snapshot: no rate yet
    assert replica["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    assert len(replica["requests"]) == 50 and replica["num_live_reqs"] == 300  # the default bound
    assert {"batches", "ranks", "num_running_reqs", "num_waiting_reqs", "cache_hit_rate_total"} <= set(
        replica
    )
    for _ in range(10):
        tm.metrics.on_first_token(0.2, None, dp_rank=1)  # type: ignore[union-attr]
    # The window keeps a snapshot only every half second: pretend the first one is older.
    window_snapshots = _window(client).snapshots
    old = window_snapshots[0]
    window_snapshots[0] = Snapshot(old.time - 2.0, old.counters, old.histograms)
    second = client.get("/dashboard/state").json()
    r0, r1 = second["replicas"]
    assert r0["prefill_tokens_per_s"] == pytest.approx(100 / 2.0, rel=0.05)
    assert r0["decode_tokens_per_s"] == pytest.approx(2 * r0["prefill_tokens_per_s"])
    assert r0["cache_hit_rate"] == pytest.approx(0.5)
    assert r0["ttft"]["count"] == 0 and r1["ttft"]["count"] == 10
    assert 0.1 < r1["ttft"]["p50"] <= 0.25 and r1["ttft"]["p99"] <= 0.25


def _window(client: TestClient) -> MetricsWindow:
    return client.app.state.dashboard_window  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("query", "status", "rows"),
    [
        ("?max_rows=3", 200, 3),
        ("?max_rows=0", 200, 0),
        ("?max_rows=201", 400, None),
        ("?max_rows=-1", 400, None),
    ],
)
def test_rows_are_bounded(query: str, status: int, rows: int | None) -> None:
    resp = _client(StubTokenizerManager()).get("/dashboard/state" + query)
    assert resp.status_code == status, resp.text
    if rows is not None:
        assert len(resp.json()["replicas"][0]["requests"]) == rows


def test_without_metrics_there_are_no_percentiles() -> None:
    state = _client(StubTokenizerManager(metrics=False)).get("/dashboard/state").json()
    assert state["metrics_enabled"] is False and state["replicas"][0]["ttft"] is None


def test_api_key_guards_the_data_not_the_files() -> None:
    client = _client(StubTokenizerManager(api_key=KEY))
    assert client.get("/dashboard").status_code == 200
    assert client.get("/dashboard/app.js").status_code == 200
    refused = client.get("/dashboard/state")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/dashboard/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.get("/dashboard/state", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["replicas"]
    # Only the listed files are public: any other path under /dashboard needs the key.
    assert client.get("/dashboard/secret").status_code == 401


def test_not_ready_is_503() -> None:
    assert _client(StubTokenizerManager(), ready=False).get("/dashboard/state").status_code == 503


def test_disable_dashboard_removes_every_route() -> None:
    tm = StubTokenizerManager(disable_dashboard=True)
    client = _client(tm)
    for path in [*ASSETS, "/dashboard/state"]:
        assert client.get(path).status_code == 404, path
    assert not tm.control.asked  # nothing reached the schedulers
    assert "/dashboard" not in client.get("/openapi.json").json()["paths"]


def test_quantile_interpolates_within_buckets() -> None:
    bounds = (1.0, 2.0, 4.0)
    assert quantile(bounds, [0, 10, 0], 10, 0.5) == pytest.approx(1.5)
    assert quantile(bounds, [5, 5, 0], 10, 0.5) == pytest.approx(1.0)
    assert quantile(bounds, [0, 0, 0], 3, 0.5) == 4.0  # everything above the last bound
    assert quantile(bounds, [0, 0, 0], 0, 0.5) is None


def test_window_survives_counter_resets_and_stays_bounded() -> None:
    window = MetricsWindow(keep_s=10.0, min_interval_s=0.5)
    for i in range(100):
        window.observe(Snapshot(float(i), {"0/hits": float(i)}, {"0/ttft": Counts((i, 0), i)}))
    assert len(window.snapshots) <= 12 and window.snapshots[0].time >= 89.0
    reset = Snapshot(100.0, {"0/hits": 3.0}, {"0/ttft": Counts((1, 0), 1)})  # a cache flush
    assert window.rate(reset, "0/hits") == pytest.approx(3.0 / 5.0)
    assert window.percentiles(reset, "0/ttft", LATENCY_BUCKETS[:2])["count"] == 1
    window.observe(Snapshot(99.2, {}, {}))  # too close to the last one: not kept
    assert window.snapshots[-1].time == 99.0


def test_state_asks_each_scheduler_once_per_call() -> None:
    tm = StubTokenizerManager(dp_size=3)
    client = _client(tm)
    assert client.get("/dashboard").status_code == 200
    assert not tm.control.asked  # the page alone costs the schedulers nothing
    client.get("/dashboard/state?max_rows=7")
    assert [m.max_rows for m in tm.control.asked] == [7]  # one request, answered by each replica


def test_hit_rate_falls_back_to_the_longer_window() -> None:
    from radixserve.entrypoints.dashboard.state import _hit_rate

    window = MetricsWindow()
    window.observe(Snapshot(0.0, {"0/cache_hit_tokens": 0.0, "0/cache_query_tokens": 0.0}))
    window.observe(Snapshot(20.0, {"0/cache_hit_tokens": 30.0, "0/cache_query_tokens": 40.0}))
    now = Snapshot(22.0, {"0/cache_hit_tokens": 30.0, "0/cache_query_tokens": 40.0})  # no lookup since 20 s
    assert window.ratio(now, "0/cache_hit_tokens", "0/cache_query_tokens") is None
    assert _hit_rate(now, window, 0) == pytest.approx(0.75)
