"""/openapi.json is the contract (issue 46, item 7): schemathesis calls every operation of the
document in-process (ASGI; the app and its TokenizerManager in this process, the fake scheduler
and the detokenizer as children) and checks that each answer's status, Content-Type, headers and
body are the ones declared, the control routes included (the fake answers them: fake_control.py).

Bounded to EXAMPLES_PER_OPERATION cases per operation and mode (~25-30 s here); run more with
RADIXSERVE_CONTRACT_EXAMPLES=200 (the nightly target, docs/http_api.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed (a [test] extra: pip install -e '.[test]')"
)
from fastapi import FastAPI  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.python import asgi  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_scheduler import run_fake_scheduler, write_tiny_tokenizer  # noqa: E402
from schema_fuzz import fuzz  # noqa: E402

from radixserve.entrypoints.http_server import ServerState, create_app  # noqa: E402
from radixserve.entrypoints.subprocesses import launch_subprocesses  # noqa: E402
from radixserve.managers.hf_tokenizer import load_tokenizer  # noqa: E402
from radixserve.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from radixserve.server_args import prepare_server_args  # noqa: E402
from radixserve.utils.network import PortArgs  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# 8: as many as test_http_fuzz.py[8] drew over HTTP when it ran in make test (it covers its routes).
EXAMPLES_PER_OPERATION = int(os.environ.get("RADIXSERVE_CONTRACT_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    tok_dir = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(tok_dir)
    # schemathesis' in-process client sends `Host: testserver`.
    args = prepare_server_args(["--model-path", tok_dir, "--allowed-hosts", "testserver"])
    port_args = PortArgs.create()
    os.environ["FAKE_STEP_S"] = "0.0005"  # the child reads it: requests may ask for the whole context
    try:
        children, info = launch_subprocesses(args, port_args, run_fake_scheduler)
    finally:
        del os.environ["FAKE_STEP_S"]
    tm = TokenizerManager(args, port_args, info, load_tokenizer(args))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await tm.start()  # on schemathesis' event loop, which serves every call
        yield
        await tm.close()

    try:
        yield create_app(ServerState(tm=tm, ready=True), lifespan=lifespan)
    finally:
        asgi.shutdown_lifespans()
        children.terminate()
        port_args.cleanup()


def test_every_operation_answers_as_documented(app: FastAPI) -> None:
    api = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in api.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/open_session", "/get_weights_by_name", "/update_weights_from_disk", "/generate"} <= paths
    assert {
        "/v1/files",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}/cancel",
    } <= paths
    calls = 0
    for operation in operations:
        calls += fuzz(operation, GenerationMode.POSITIVE, EXAMPLES_PER_OPERATION)
        if len(operation.body):  # nothing else here can be made invalid: the search only costs time
            calls += fuzz(operation, GenerationMode.NEGATIVE, EXAMPLES_PER_OPERATION)
    assert calls > 3 * len(operations)


def test_a_control_refusal_is_the_error_envelope_with_sglangs_fields(app: FastAPI) -> None:
    api = schemathesis.openapi.from_asgi("/openapi.json", app)
    operation = api["/update_weights_from_disk"]["POST"]
    with asgi.get_client(app) as client:
        resp = client.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
        opened = client.post("/open_session", json={"capacity_of_str_len": 10})
    body = resp.json()
    assert resp.status_code == 400 and body["success"] is False and body["message"]
    assert body["error"]["message"] == body["message"] and body["error"]["code"] == 400
    operation.validate_response(resp)  # raises when the answer is not the declared one
    assert opened.status_code == 200 and isinstance(opened.json(), str)  # SGLang's bare string
