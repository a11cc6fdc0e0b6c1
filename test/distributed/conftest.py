"""Fixtures shared by the multi-rank and data-parallel tests."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "server"))
from server_helpers import Server, SharedServers, held_by_fixture, stop_after_last_users  # noqa: E402

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
    with held_by_fixture(shared, "dp_servers"):
        yield shared


pytest_runtest_teardown = stop_after_last_users
