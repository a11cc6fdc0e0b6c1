"""Property-based fuzzing of every route from the server's own /openapi.json (schemathesis), over
the real HTTP server with the fake scheduler: no 5xx, no hang, and every answer (status, Content-
Type, headers, JSON body, each SSE event) matches what the document declares; schema-invalid
requests are refused with a 4xx. Bounded to about 400 cases (~25 s here, with the server start)."""

from __future__ import annotations

import os
import sys

import pytest

schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed (a [test] extra: pip install -e '.[test]')"
)
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis depends on it)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402
from schemathesis.specs.openapi import checks as oa_checks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_scheduler import write_tiny_tokenizer  # noqa: E402
from server_helpers import Server, start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXAMPLES_PER_OPERATION = 20
HANG_S = 30.0  # no answer within this is a hang
# positive_data_acceptance is left out: the schema cannot state every cross-field rule (exactly
# one of text / input_ids, min_new_tokens <= max_new_tokens, ...), which the server answers 400.
CHECKS = [
    st_checks.not_a_server_error,
    oa_checks.status_code_conformance,
    oa_checks.content_type_conformance,
    oa_checks.response_headers_conformance,
    oa_checks.response_schema_conformance,  # SSE events included
    oa_checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    tok_dir = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(tok_dir)
    server = Server.fake(tok_dir, step_s=0.0005)  # generated requests may ask for the whole context
    try:
        yield start_servers({"s": server})["s"]
    finally:
        server.stop()


def _fuzz(operation, mode) -> int:  # noqa: ANN001 - schemathesis' operation type
    """Run one operation's generated cases; return their number. A failed check raises (a
    FailureGroup naming every failed check, with a curl line) after hypothesis shrank the case."""
    calls = 0

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:  # noqa: ANN001
        nonlocal calls
        calls += 1
        response = case.call(timeout=HANG_S)  # raises on a hang
        case.validate_response(response, checks=CHECKS)

    try:
        run()
    except Unsatisfiable:  # no schema-invalid request exists (an operation without parameters)
        pass
    return calls


def test_every_route_conforms_and_never_fails(fuzz_server: Server) -> None:
    # schemathesis' own pytest integration (schema.parametrize / from_fixture) does not run
    # under pytest 9, so the operations are driven through its Python API.
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    calls = 0
    # The control routes (sessions, weights, memory, profiling) are fuzzed in-process in
    # test_openapi_contract.py (the fake's control plane) and run on a real server in
    # test_control_http.py; over HTTP only the serving routes, to keep this run short.
    from radixserve.entrypoints.control_routes import CONTROL_BODIES, CONTROL_TEXT_ANSWERS

    control = {*CONTROL_BODIES, *CONTROL_TEXT_ANSWERS, "/continue_generation"}
    operations = [op for op in (r.ok() for r in api.get_all_operations()) if op.path not in control]
    assert len(operations) >= 14
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls += _fuzz(operation, mode)
    assert calls > 10 * len(operations)
