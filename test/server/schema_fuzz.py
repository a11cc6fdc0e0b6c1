"""Drive one schemathesis operation through hypothesis: the checks and the loop that
test_http_fuzz.py (over HTTP) and test_openapi_contract.py (in-process) share. Import it only
after `pytest.importorskip("schemathesis")`."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings  # schemathesis depends on hypothesis
from hypothesis.errors import Unsatisfiable
from schemathesis import checks as st_checks
from schemathesis.specs.openapi import checks as oa_checks

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


def fuzz(operation, mode, max_examples: int) -> int:  # noqa: ANN001 - schemathesis' types
    """Run one operation's generated cases; return their number. A failed check raises (a
    FailureGroup naming every failed check, with a curl line) after hypothesis shrank the case."""
    calls = 0

    @settings(
        max_examples=max_examples,
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
