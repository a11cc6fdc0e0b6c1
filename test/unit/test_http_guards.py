"""The HTTP server's guards and protocol details, in-process (no model, no scheduler): the Host
check, JSON-only bodies, the body size limit, 405 with Allow, a Content-Type on every answer,
/openapi.json."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from radixserve.entrypoints import client_apis
from radixserve.entrypoints.http_guards import MULTIPART_PATHS, allowed_host_names, host_name, is_json_type
from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.managers.lora_registry import LoRARegistry
from radixserve.server_args import ServerArgs


class StubTokenizerManager:
    """Just what create_app reads; no request here gets past validation to the scheduler."""

    def __init__(self, **args: object) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny", **args)  # type: ignore[arg-type]
        self.model_path = "/models/tiny"
        self.served_model_name = "tiny"
        self.context_len = 128
        self.metrics = None
        self.weight_version = "default"
        self.is_generation = True
        self.embedding_info = None
        # No adapters (no --enable-lora); /v1/models lists what it holds. Nothing reaches `ask`.
        self.lora = LoRARegistry(self.server_args, ask=None, live_lora_ids=list)  # type: ignore[arg-type]


def client(ready: bool = True, **args: object) -> TestClient:
    app = create_app(ServerState(tm=StubTokenizerManager(**args), ready=ready))  # type: ignore[arg-type]
    return TestClient(app, base_url="http://127.0.0.1:30000")


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:30000", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:30000", "::1"),
        ("[::1]", "::1"),
        ("example.com.:80", "example.com"),
        ("evil.example:30000", "evil.example"),
    ],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_allowed_host_names() -> None:
    loopback = {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names("127.0.0.1", None) == loopback
    assert allowed_host_names("127.0.0.1", "a.example, B.example") == loopback | {"a.example", "b.example"}
    assert allowed_host_names("10.0.0.5", None) == {"10.0.0.5"}
    assert allowed_host_names("localhost", None) == loopback
    assert allowed_host_names("0.0.0.0", None) is None  # a wildcard bind cannot know its names
    assert allowed_host_names("::", "api.example") == loopback | {"api.example", "::"}
    # launch_server's warm-up calls http://<bind host>:<port>: a 0.0.0.0 bind must accept it
    assert "0.0.0.0" in allowed_host_names("0.0.0.0", "api.example")
    assert allowed_host_names("127.0.0.1", "*") is None


def test_host_check_and_api_key_order() -> None:
    c = client(api_key="k")
    resp = c.get("/v1/models", headers={"Host": "rebound.example"})
    assert resp.status_code == 400 and "rebound.example" in resp.json()["error"]["message"]
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client(host="0.0.0.0").get("/v1/models", headers={"Host": "anything.example"}).status_code == 200
    allowed = client(allowed_hosts="api.example")
    assert allowed.get("/v1/models", headers={"Host": "api.example:443"}).status_code == 200


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        (None, False),
    ],
)
def test_is_json_type(value: str | None, ok: bool) -> None:
    assert is_json_type(value) is ok


def test_body_limit_is_413_with_or_without_content_length() -> None:
    c = client(max_request_body_bytes=100)
    body = b'{"prompt": "' + b"x" * 200 + b'"}'
    for content in (body, iter([body[:60], body[60:]])):  # the second is sent chunked
        resp = c.post("/v1/tokenize", content=content, headers={"Content-Type": "application/json"})
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == 413 and "100 bytes" in resp.json()["error"]["message"]
    resp = c.post("/v1/tokenize", content=b'{"prompt": 5}', headers={"Content-Type": "application/json"})
    assert resp.status_code == 400  # under the limit: parsed (and refused for its type)


def test_405_names_the_allowed_methods() -> None:
    c = client()
    for method, path, allow in [
        ("DELETE", "/generate", {"POST", "PUT"}),
        ("GET", "/flush_cache", {"POST"}),
        ("GET", "/abort_request", {"POST"}),
        ("POST", "/health", {"GET"}),
        ("OPTIONS", "/v1/chat/completions", {"POST"}),  # a CORS preflight is never approved
    ]:
        resp = c.request(method, path)
        assert resp.status_code == 405, (method, path)
        assert {m.strip() for m in resp.headers["allow"].split(",")} == allow
        assert resp.json()["error"]["code"] == 405


def test_every_answer_has_a_content_type() -> None:
    c = client()
    for resp in (
        c.get("/health"),
        c.get("/get_model_info"),
        c.get("/nope"),
        client(ready=False).get("/health"),
    ):
        assert resp.headers.get("content-type"), resp
    assert c.get("/health").headers["content-type"].startswith("text/plain")


def test_openapi_declares_bodies_answers_and_errors() -> None:
    doc = client().get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in [
        ("/generate", "GenerateReqInput"),
        ("/abort_request", "AbortRequestBody"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/tokenize", "TokenizeRequest"),
        ("/v1/detokenize", "DetokenizeRequest"),
    ]:
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and model in schemas
        assert "400" in op["responses"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 128
    stream = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = stream["schema"]["properties"]["data"]["anyOf"]
    assert data[0] == {"const": "[DONE]"} and data[1]["contentMediaType"] == "application/json"
    assert data[1]["contentSchema"]["anyOf"][0]["$ref"].endswith("/ChatCompletionStreamResponse")
    assert set(doc["paths"]["/health"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/flush_cache"]) == {"post"}


def test_every_path_answers_undeclared_methods_with_405_and_allow() -> None:
    """schemathesis' unsupported_method check, for every path of the document."""
    c = client()
    doc = c.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        declared = {m.upper() for m in item}
        url = path.replace("{model_id}", "tiny")
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - declared:
            resp = c.request(method, url)
            assert resp.status_code == 405, (method, path)
            assert {m.strip() for m in resp.headers["allow"].split(",")} == declared, (method, path)


def _post_routes(app: FastAPI) -> list[tuple[str, str]]:
    return sorted(
        (route.path, method)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods & {"POST", "PUT"}
    )


def test_every_post_route_takes_json_only() -> None:
    """A page on another site can send text/plain, a form or a body of no type without a CORS
    preflight: every POST/PUT route refuses them (415, the error envelope), read-only or not."""
    app = create_app(ServerState(tm=StubTokenizerManager(), ready=True))  # type: ignore[arg-type]
    c = TestClient(app, base_url="http://127.0.0.1:30000")
    routes = _post_routes(app)
    assert len(routes) >= 30 and ("/get_weights_by_name", "POST") in routes
    cross_site = [
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {},  # a body without a Content-Type
    ]
    for path, method in routes:
        for headers in cross_site:
            if path in MULTIPART_PATHS and "multipart" in headers.get("Content-Type", ""):
                # A file upload takes a form, but not from a page (a browser always sends Origin).
                headers = {**headers, "Origin": "https://evil.example"}
            resp = c.request(method, path, content=b'{"name": "model.norm.weight"}', headers=headers)
            assert resp.status_code == 415, (path, method, headers, resp.text)
            assert "application/json" in _error_message(path, resp.json())
        resp = c.request(method, path, headers={"Origin": "https://evil.example"})  # no body, from a page
        assert resp.status_code == 415, (path, method)


def _error_message(path: str, body: dict) -> str:
    """The message of an error answer, in the shape of the route's client family."""
    dialect = client_apis.error_model(path)
    if dialect is None:
        assert body["error"]["code"] == 415
        return body["error"]["message"]
    dialect.model_validate(body)  # Anthropic's or Ollama's error shape
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


def test_a_post_without_body_or_type_is_not_415() -> None:
    """`curl -X POST url` (no body, no Content-Type, no Origin): routes without a body take it; a
    route that needs one says what is missing (400)."""
    c = client()
    for path in ("/v1/tokenize", "/generate", "/get_weights_by_name"):
        resp = c.post(path)
        assert resp.status_code == 400, (path, resp.text)
    assert c.post("/v1/tokenize", json={"prompt": 5}).status_code == 400  # JSON: parsed, then refused


def test_openapi_lists_415_and_the_control_answers() -> None:
    """The statuses and bodies the routes really answer (issue 46, item 7)."""
    doc = client().get("/openapi.json").json()
    error = "#/components/schemas/ErrorResponse"
    for path, item in doc["paths"].items():
        dialect = client_apis.error_model(path)  # the Anthropic and Ollama routes' own shapes
        expected = error if dialect is None else f"#/components/schemas/{dialect.__name__}"
        for method, op in item.items():
            responses = op["responses"]
            assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": expected} or (
                responses["400"]["content"]["application/json"]["schema"]["allOf"][0] == {"$ref": expected}
            ), path
            if method in ("post", "put"):
                assert responses["415"]["content"]["application/json"]["schema"] == {"$ref": expected}, path
            assert ("401" in responses) == (path not in ("/health", "/metrics")), path
    paths = doc["paths"]
    ok = paths["/open_session"]["post"]["responses"]["200"]["content"]
    assert ok == {"application/json": {"schema": {"type": "string"}}}  # SGLang's bare session id
    assert set(paths["/close_session"]["post"]["responses"]["200"]["content"]) == {"text/plain"}
    weights = paths["/update_weights_from_disk"]["post"]["responses"]
    assert weights["200"]["content"]["application/json"]["schema"]["required"] == ["success", "message"]
    refused = weights["400"]["content"]["application/json"]["schema"]["allOf"]
    assert refused[0] == {"$ref": error} and {"success", "message"} <= set(refused[1]["properties"])
    rows = paths["/get_weights_by_name"]["post"]["responses"]["200"]["content"]["application/json"]
    assert {"type": "array"} in rows["schema"]["anyOf"]


def test_a_file_upload_takes_a_form_only_without_origin() -> None:
    """POST /v1/files reads multipart/form-data from SDKs and curl (no Origin); the same form
    from a page (Origin) is refused like any cross-site body."""
    c = client()
    form = {"Content-Type": "multipart/form-data; boundary=b"}
    body = b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n'
    resp = c.post("/v1/files", content=body, headers=form)
    assert resp.status_code == 400 and "file" in resp.json()["error"]["message"]  # read: no file part
    resp = c.post("/v1/files", content=body, headers={**form, "Origin": "https://evil.example"})
    assert resp.status_code == 415
    assert c.post("/v1/tokenize", content=body, headers=form).status_code == 415  # other routes: JSON only
