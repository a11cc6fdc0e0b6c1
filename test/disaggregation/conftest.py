"""The colocated reference server that the PD files compare with, shared by them."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))
from server_helpers import Server, SharedServers, held_by_fixture, stop_after_last_users  # noqa: E402

# The tiny model served whole: test_pd_servers.py and test_pd_tp.py compare their prefill/decode
# pairs' tokens and token counters with it (counters as deltas; nothing else is left behind).
COLOCATED_FLAGS = ("--max-total-tokens", "8192", "--chunked-prefill-size", "256", "--enable-metrics")


@pytest.fixture(scope="session")
def pd_reference(tiny_llama_path: str) -> SharedServers:
    """`pd_reference.get("colocated")`: started on first use, stopped after the last test that uses it."""
    shared = SharedServers({"colocated": lambda: Server.real(tiny_llama_path, *COLOCATED_FLAGS)}, timeout=300)
    with held_by_fixture(shared, "pd_reference"):
        yield shared


pytest_runtest_teardown = stop_after_last_users
