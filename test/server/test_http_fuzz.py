"""Property-based fuzzing of every route from the server's own /openapi.json (schemathesis), over
the real HTTP server with the fake scheduler: no 5xx, no hang, and every answer (status, Content-
Type, headers, JSON body, each SSE event) matches what the document declares; schema-invalid
requests are refused with a 4xx. 8 and 25 examples per operation and mode, both in `make test-all`
only: `make test` runs the same fuzzing in-process (test_openapi_contract.py)."""

from __future__ import annotations

import os
import sys

import pytest

schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed (a [test] extra: pip install -e '.[test]')"
)
from schemathesis import GenerationMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_scheduler import write_tiny_tokenizer  # noqa: E402
from schema_fuzz import fuzz  # noqa: E402
from server_helpers import Server, start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(240)

BATCH_PATHS = ("/v1/files", "/v1/batches")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    tok_dir = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(tok_dir)
    server = Server.fake(tok_dir, step_s=0.0005)  # generated requests may ask for the whole context
    try:
        yield start_servers({"s": server})["s"]
    finally:
        server.stop()


# make test-all only (docs/testing.md): test_openapi_contract.py fuzzes every operation, these
# serving routes included, in-process with the same checks (schema_fuzz.fuzz) and as many examples
# as [8]; test_http_hardening.py checks real HTTP answers and SSE events against the document.
@pytest.mark.slow
@pytest.mark.parametrize("examples", [8, 25])
def test_every_route_conforms_and_never_fails(fuzz_server: Server, examples: int) -> None:
    # schemathesis' own pytest integration (schema.parametrize / from_fixture) does not run
    # under pytest 9, so the operations are driven through its Python API.
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    calls = 0
    # The control routes (sessions, weights, memory, profiling) are fuzzed in-process in
    # test_openapi_contract.py (the fake's control plane) and run on a real server in
    # test_control_http.py; over HTTP only the serving routes, to keep this run short. The
    # Files and Batch routes likewise: in-process there, on a real server in test_batch_api.py.
    from radixserve.entrypoints.control_routes import CONTROL_BODIES, CONTROL_TEXT_ANSWERS

    control = {*CONTROL_BODIES, *CONTROL_TEXT_ANSWERS, "/continue_generation"}
    control |= {p for p in (r.ok().path for r in api.get_all_operations()) if p.startswith(BATCH_PATHS)}
    operations = [op for op in (r.ok() for r in api.get_all_operations()) if op.path not in control]
    assert len(operations) >= 14
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls += fuzz(operation, mode, examples)
    assert calls > examples // 2 * len(operations)
