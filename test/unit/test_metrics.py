"""The Prometheus text the TokenizerManager serves: one series per data-parallel replica for the
counters and histograms (the replica that served the request) and, from the replicas' own load
reports, for the load gauges; the single-replica output keeps unlabeled series."""

from __future__ import annotations

from radixserve.utils.metrics import ServerMetrics


def samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_histograms_and_counters_per_replica():
    m = ServerMetrics(max_total_num_tokens=2000, dp_size=2)
    m.on_first_token(0.02, queue_time=0.001, dp_rank=1)
    m.on_tokens(4, 0.04, dp_rank=1)  # 4 tokens in 40 ms: 4 ITL samples of 10 ms
    m.on_finish(10, 0, 0.3, aborted=False, dp_rank=1)
    m.on_finish(7, 0, 0.03, aborted=False, dp_rank=0)
    got = samples(m.render())
    assert got['sglang:time_to_first_token_seconds_count{dp_rank="1"}'] == 1
    assert got['sglang:time_to_first_token_seconds_count{dp_rank="0"}'] == 0
    assert got['sglang:time_to_first_token_seconds_bucket{dp_rank="1",le="0.025"}'] == 1
    assert got['sglang:inter_token_latency_seconds_count{dp_rank="1"}'] == 4
    assert got['sglang:e2e_request_latency_seconds_sum{dp_rank="0"}'] == 0.03
    assert got['sglang:e2e_request_latency_seconds_bucket{dp_rank="1",le="+Inf"}'] == 1
    assert got['sglang:prompt_tokens_total{dp_rank="1"}'] == 10
    assert not any(k.startswith("sglang:e2e_request_latency_seconds_count ") for k in got)


def test_load_gauges_come_from_each_replicas_report():
    m = ServerMetrics(max_total_num_tokens=2000, dp_size=2)
    m.set_load(num_running=5, num_queued=1, tokens_in_flight=50)  # the TM's view: not per replica
    m.set_replica_loads(
        [
            {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 250},
            {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 1500},
        ]
    )
    got = samples(m.render())
    assert got['sglang:num_running_reqs{dp_rank="0"}'] == 2
    assert got['sglang:num_queue_reqs{dp_rank="0"}'] == 1
    assert got['sglang:num_running_reqs{dp_rank="1"}'] == 2
    assert got['sglang:token_usage{dp_rank="0"}'] == 0.25  # 250 of the replica's 1000
    assert got['sglang:token_usage{dp_rank="1"}'] == 1.0  # waiting prompts count: capped
    assert "sglang:num_running_reqs" not in got  # no unlabeled series beside the replicas'


def test_one_replica_keeps_unlabeled_series():
    m = ServerMetrics(max_total_num_tokens=1000)
    m.on_first_token(0.02, queue_time=None)
    m.on_finish(10, 4, 0.3, aborted=False)
    m.set_load(num_running=1, num_queued=2, tokens_in_flight=100)
    text = m.render()
    assert "dp_rank" not in text
    got = samples(text)
    assert got["sglang:time_to_first_token_seconds_count"] == 1
    assert got['sglang:time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert got["sglang:num_queue_reqs"] == 2 and got["sglang:token_usage"] == 0.1
    assert got["sglang:cache_hit_rate"] == 0.4
