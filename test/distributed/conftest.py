"""Fixtures shared by the multi-rank and data-parallel tests."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "server"))
from server_helpers import Server, SharedServers  # noqa: E402

# The tiny model at one replica and at --dp-size 2: test_data_parallel_server.py's subjects, and
# the gateway's workers in test_gateway.py (a plain one and a DP one behind its router; the DP one
# alone behind --dp-aware). Neither file leaves state another reads: counters are compared as
# deltas, caches are flushed by whoever needs them empty.
DP_SERVER_FLAGS = ("--max-total-tokens", "4096", "--page-size", "16", "--chunked-prefill-size", "64")
# The test machine is shared and often overloaded: a replica's start-up (the warm-up) can be slow.
DP_START_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def builtin_model_path() -> str:
    """The built-in model's folder (converted once by `make setup`); skip when it is missing."""
    from radixserve.model_loader.default_model import ensure_default_model

    try:
        return str(ensure_default_model(show_progress=False))
    except Exception as exc:
        pytest.skip(f"built-in model unavailable: {exc}")


@pytest.fixture(scope="session")
def dp_servers(tiny_model_dir) -> SharedServers:
    """`dp_servers.get("dp1", "dp2")`: started on first use, shared by the session."""
    path = tiny_model_dir("llama")
    dp2_flags = ("--dp-size", "2", "--load-balance-method", "round_robin", "--enable-metrics")
    shared = SharedServers(
        {
            "dp1": lambda: Server.real(path, *DP_SERVER_FLAGS),
            "dp2": lambda: Server.real(path, *DP_SERVER_FLAGS, *dp2_flags),
        },
        timeout=DP_START_TIMEOUT_S,
    )
    _LIVE.append(shared)
    try:
        yield shared
    finally:
        shared.stop()


_LIVE: list[SharedServers] = []


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (a router in front) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for shared in _LIVE:
        shared.stop_after_last_user(item, "dp_servers")
