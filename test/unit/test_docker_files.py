"""docker/ cannot be built here (no Docker): these checks keep its files honest. Every flag an
image or the compose file passes to the server exists in ServerArgs and parses; the CUDA image
starts from NVIDIA's CUDA image with torch's CUDA wheel and the gpu extra; every metric the Grafana
dashboard queries is one /metrics exports, so the dashboard cannot drift from the metrics module."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from radixserve.server_args import prepare_server_args
from radixserve.utils.metrics import ServerMetrics

DOCKER = Path(__file__).resolve().parents[2] / "docker"
yaml = pytest.importorskip("yaml")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def server_flags(argv: list[str]) -> list[str]:
    """The launch_server flags in a command line (everything after the module name)."""
    i = argv.index("radixserve.launch_server")
    assert argv[i - 1] == "-m"
    return argv[i + 1 :]


def check_flags(flags: list[str]) -> None:
    """Every flag exists and parses (argparse exits on an unknown one) and validates."""
    try:
        args = prepare_server_args(flags)
    except SystemExit as exc:
        raise AssertionError(f"launch_server refuses {flags}") from exc
    args.validate()


def test_cuda_dockerfile() -> None:
    steps = instructions(DOCKER / "Dockerfile.cuda")
    froms = [a for k, a in steps if k == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[\w-]*devel-ubuntu\d+\.\d+", froms[0])
    cuda = re.search(r":(\d+)\.(\d+)", froms[0])
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG")
    # torch's CUDA wheel from PyTorch's index, for the base image's CUDA major.minor.
    assert args["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{cuda[1]}{cuda[2]}"
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert "torch==${TORCH_VERSION} --index-url ${TORCH_INDEX}" in runs
    assert re.search(r"pip install -e '\.\[[\w,]*gpu[\w,]*\]'", runs)  # Triton + FlashInfer
    (entry,) = [exec_form(a) for k, a in steps if k == "ENTRYPOINT"]
    flags = server_flags(entry)
    check_flags(flags)
    parsed = prepare_server_args(flags)
    assert parsed.device == "cuda" and parsed.attention_backend in ("triton", "flashinfer")
    assert parsed.host == "0.0.0.0"
    (expose,) = [a for k, a in steps if k == "EXPOSE"]
    assert int(expose) == parsed.port
    assert [exec_form(a) for k, a in steps if k == "CMD"] == [[]]  # docker run's arguments add flags


def test_cpu_dockerfile_flags() -> None:
    steps = instructions(DOCKER / "Dockerfile")
    (cmd,) = [exec_form(a) for k, a in steps if k == "CMD"]
    check_flags(server_flags(cmd))


def test_compose_serves_metrics_to_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"radixserve", "prometheus", "grafana"} <= set(services)
    command = services["radixserve"]["command"]
    flags = server_flags(command if isinstance(command, list) else shlex.split(command))
    check_flags(flags)
    parsed = prepare_server_args(flags)
    assert parsed.enable_metrics and parsed.host == "0.0.0.0"
    assert (DOCKER.parent / services["radixserve"]["build"]["dockerfile"]).is_file()
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"radixserve:{parsed.port}"]
    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert (DOCKER / mount.split(":")[0]).exists(), mount
    datasources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    dashboard = json.loads((DOCKER / "grafana" / "radixserve.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} <= uids


def exported_series() -> set[str]:
    """Every series name /metrics can export (histograms' _bucket/_sum/_count included), with the
    optional speculative series and the per-replica labels on."""
    names = set()
    for metrics in (ServerMetrics(1000, dp_size=1, speculative=True), ServerMetrics(1000, dp_size=2)):
        for line in metrics.render().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_grafana_queries_only_exported_metrics() -> None:
    dashboard = json.loads((DOCKER / "grafana" / "radixserve.json").read_text())
    exported = exported_series()
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", expr))
            assert names, f"{panel['title']}: {expr} queries no radixserve metric"
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} are not exported"
            for group in re.findall(r"\bby \(([^)]*)\)", expr):  # labels the server sets, and le
                assert {g.strip() for g in group.split(",")} <= {"le", "dp_rank", "model_name"}, expr
            queried |= names
    # The panels the dashboard promises: load, KV, cache, throughput and the three latencies.
    for base in ("num_running_reqs", "num_queue_reqs", "token_usage", "cached_tokens_total"):
        assert f"sglang:{base}" in queried
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"sglang:{hist}_bucket" in queried
    assert "sglang:generation_tokens_total" in queried


def test_the_name_check_catches_a_drifted_name() -> None:
    assert "sglang:time_to_first_token_seconds_bucket" in exported_series()
    assert "sglang:num_running_requests" not in exported_series()  # a plausible typo
