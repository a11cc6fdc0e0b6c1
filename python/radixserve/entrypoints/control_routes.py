"""The control plane's HTTP routes (SGLang's names, bodies and answers; docs/http_api.md).

Bodies are validated strictly (a wrong type is a 400 in the error envelope). Weight routes answer
SGLang's {"success", "message"} object: 200 when applied, 400 when refused (the old weights are
kept), and a refusal carries the error envelope's `error` beside SGLang's fields. Every route is
POST: they change state, and a browser can be made to send a GET.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, create_model

from radixserve.entrypoints.big_json import streamed_json
from radixserve.entrypoints.http_guards import error_response, json_body, read_body
from radixserve.entrypoints.openai.protocol import error_body, error_type
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import TokenizerManager


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OpenSessionBody(_Body):
    capacity_of_str_len: int = Field(ge=0)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)


class CloseSessionBody(_Body):
    session_id: str


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupBody(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = io.DEFAULT_WEIGHT_GROUP
    backend: str = "nccl"


class GetWeightsByNameBody(_Body):
    name: str
    truncate_size: int = Field(default=100, ge=0)


class PauseGenerationBody(_Body):
    mode: str = "abort"


class ProfileBody(_Body):
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = Field(default=None, ge=1)
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None


class SlowDownBody(_Body):
    forward_sleep_time: float | None = None


class SetInternalStateBody(_Body):
    server_args: dict[str, Any]


class LoadLoRAAdapterBody(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRAAdapterBody(_Body):
    lora_name: str = Field(min_length=1, max_length=256)


def _body_of(message: type) -> type[_Body]:
    """The body of a route that sends exactly the fields of `message` (a dataclass): its fields,
    types and defaults, so they are written once."""
    hints = get_type_hints(message)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(message)
    }
    return create_model(message.__name__.removesuffix("ReqInput") + "Body", __base__=_Body, **fields)


def _sends(
    message: type, optional: bool = False, body: type[_Body] | None = None
) -> tuple[type[_Body], bool, type]:
    """A MESSAGE_ROUTES row: the body (by default the message's own fields), whether it may be
    omitted, the message."""
    return body or _body_of(message), optional, message


# Routes that pass their body on as one control message of the same fields and answer SGLang's
# {"success", "message"} (_outcome): path -> (body, whether it may be omitted, message), sent
# with ControlClient.ask. A body of its own where the HTTP form differs (text payloads, bounds).
MESSAGE_ROUTES: dict[str, tuple[type[_Body], bool, type]] = {
    "/update_weights_from_disk": _sends(io.UpdateWeightFromDiskReqInput),
    "/update_weights_from_tensor": _sends(
        io.UpdateWeightsFromTensorReqInput, body=UpdateWeightsFromTensorBody
    ),
    "/init_weights_update_group": _sends(io.InitWeightsUpdateGroupReqInput, body=InitWeightsUpdateGroupBody),
    "/update_weights_from_distributed": _sends(io.UpdateWeightsFromDistributedReqInput),
    "/destroy_weights_update_group": _sends(io.DestroyWeightsUpdateGroupReqInput, optional=True),
    "/release_memory_occupation": _sends(io.ReleaseMemoryOccupationReqInput, optional=True),
    "/resume_memory_occupation": _sends(io.ResumeMemoryOccupationReqInput, optional=True),
    "/slow_down": _sends(io.SlowDownReqInput, body=SlowDownBody),
}
# Request bodies by route, for /openapi.json (openapi_spec.py).
CONTROL_BODIES: dict[str, type[BaseModel]] = {
    "/open_session": OpenSessionBody,
    "/close_session": CloseSessionBody,
    **{path: body for path, (body, _, _) in MESSAGE_ROUTES.items()},
    "/get_weights_by_name": GetWeightsByNameBody,
    "/pause_generation": PauseGenerationBody,
    "/start_profile": ProfileBody,
    "/set_internal_state": SetInternalStateBody,
    "/load_lora_adapter": LoadLoRAAdapterBody,
    "/unload_lora_adapter": UnloadLoRAAdapterBody,
}
# Routes answering SGLang's LoRAUpdateOutput {"success", "error_message", "loaded_adapters"}.
CONTROL_LORA_ANSWERS = frozenset({"/load_lora_adapter", "/unload_lora_adapter"})
CONTROL_TEXT_ANSWERS = frozenset({"/start_profile", "/stop_profile", "/freeze_gc", "/close_session"})
# Routes answering _outcome; the others answer a session id (/open_session), a weight's rows
# (/get_weights_by_name) or {"updated", ...} (/set_internal_state).
CONTROL_OUTCOME_ANSWERS = frozenset({*MESSAGE_ROUTES, "/pause_generation", "/continue_generation"})


def _json(content: Any, status: int = 200) -> Response:  # noqa: ANN401 - any JSON value
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _answer(content: dict[str, Any], ok: bool, message: str) -> Response:
    """SGLang's answer object; a refusal (400) also carries the error envelope, so that clients
    of either contract read it (the envelope's fields sit beside SGLang's)."""
    if ok:
        return _json(content)
    return _json({**error_body(message or "Refused.", error_type(400), 400), **content}, 400)


def _outcome(out: Any) -> Response:  # noqa: ANN401 - an *Output message with success/message
    content = {"success": out.success, "message": out.message}
    if getattr(out, "num_paused_requests", None) is not None:
        content["num_paused_requests"] = out.num_paused_requests
    return _answer(content, out.success, out.message)


async def _optional_body(model: type[_Body], request: Request) -> _Body:
    """Routes whose body may be omitted (`curl -X POST url`)."""
    raw = await read_body(request, request.app.state.max_body_bytes)
    return model.model_validate_json(raw or b"{}", strict=True)


def add_control_routes(app: FastAPI, tm: TokenizerManager) -> None:
    _add_session_routes(app, tm)
    for path, (body_model, optional, message) in MESSAGE_ROUTES.items():
        _add_message_route(app, tm, path, body_model, optional, message)
    _add_weight_read_route(app, tm)
    _add_pause_routes(app, tm)
    _add_operator_routes(app, tm)
    _add_lora_routes(app, tm)


def _add_message_route(
    app: FastAPI, tm: TokenizerManager, path: str, body_model: type[_Body], optional: bool, message: type
) -> None:
    name = path.removeprefix("/")  # the route's name (its OpenAPI operationId)
    read_body_as = _optional_body if optional else json_body

    async def route(request: Request) -> Response:
        body = await read_body_as(body_model, request)
        return _outcome(await tm.control.ask(message(**body.model_dump())))

    app.post(path, name=name)(route)


def _add_session_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        body = await json_body(OpenSessionBody, request)
        return _json(await tm.control.open_session(io.OpenSessionReqInput(**body.model_dump())))

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        body = await json_body(CloseSessionBody, request)
        out = await tm.control.ask(io.CloseSessionReqInput(body.session_id))
        if not out.success:
            return error_response(400, out.message)
        return PlainTextResponse("")  # SGLang's empty 200, with a Content-Type as every answer


def _add_weight_read_route(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> Response:
        body = await json_body(GetWeightsByNameBody, request)
        out = await tm.control.get_weights_by_name(io.GetWeightsByNameReqInput(body.name, body.truncate_size))
        if not out.success:
            return error_response(400, f"Get parameter by name failed: {out.message}")
        return streamed_json(out.parameter)  # up to MAX_WEIGHT_REPLY_ELEMENTS values


def _add_pause_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _optional_body(PauseGenerationBody, request)
        if body.mode not in io.PAUSE_MODES:
            return error_response(400, f"mode must be one of {list(io.PAUSE_MODES)}, got {body.mode!r}.")
        return _outcome(await tm.control.ask(io.PauseGenerationReqInput(body.mode)))

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        return _outcome(await tm.control.ask(io.ContinueGenerationReqInput()))


def _add_operator_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        body = await _optional_body(ProfileBody, request)
        out = await tm.control.ask(io.ProfileReq(io.ProfileReqType.START_PROFILE, **body.model_dump()))
        if not out.success:
            return error_response(400, out.message)
        return PlainTextResponse("Start profiling.\n")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        out = await tm.control.ask(io.ProfileReq(io.ProfileReqType.STOP_PROFILE))
        if not out.success:
            return error_response(400, out.message)
        return PlainTextResponse(f"Stop profiling. {out.message}\n")

    async def expert_distribution(action: io.ExpertDistributionReqType, said: str) -> Response:
        out = await tm.control.ask(io.ExpertDistributionReq(action))
        if not out.success:
            return error_response(400, out.message)
        # The dump's answer also names the file written (on the server's machine).
        written = f" Written to {out.message}." if action == io.ExpertDistributionReqType.DUMP_RECORD else ""
        return PlainTextResponse(f"{said}{written}\n")

    # SGLang's routes and answers, by GET or POST (one OpenAPI operation per method).
    for action, said in (
        (io.ExpertDistributionReqType.START_RECORD, "Start recording the expert distribution."),
        (io.ExpertDistributionReqType.STOP_RECORD, "Stop recording the expert distribution."),
        (io.ExpertDistributionReqType.DUMP_RECORD, "Dump expert distribution record."),
    ):
        route = f"/{action.name.split('_')[0].lower()}_expert_distribution_record"

        handler = _bound(expert_distribution, action, said)  # no parameters: nothing in the OpenAPI
        for method in ("GET", "POST"):
            app.add_api_route(route, handler, methods=[method], operation_id=f"{route[1:]}_{method.lower()}")

    @app.post("/freeze_gc")
    async def freeze_gc() -> Response:
        out = await tm.control.ask(io.FreezeGCReq())
        return PlainTextResponse(f"Garbage collection frozen. {out.message}\n")

    @app.post("/set_internal_state")
    async def set_internal_state(request: Request) -> Response:
        body = await json_body(SetInternalStateBody, request)
        out = await tm.control.ask(io.SetInternalStateReq(body.server_args))
        content = {"updated": out.updated, "server_args": out.server_args}
        if out.message:
            content["message"] = out.message
        return _answer(content, out.updated, out.message)


def _lora_answer(out: Any) -> Response:  # noqa: ANN401 - a Load/UnloadLoRAAdapterReqOutput
    content = {
        "success": out.success,
        "error_message": out.error_message,
        "loaded_adapters": out.loaded_adapters,
    }
    return _answer(content, out.success, out.error_message)


def _add_lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """SGLang's LoRA routes: 200 when done, 400 with the reason when refused (docs/lora.md)."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await json_body(LoadLoRAAdapterBody, request)
        return _lora_answer(await tm.lora.load(body.lora_name, body.lora_path, body.pinned))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await json_body(UnloadLoRAAdapterBody, request)
        return _lora_answer(await tm.lora.unload(body.lora_name))


def _bound(
    fn: Callable[[io.ExpertDistributionReqType, str], Awaitable[Response]],
    action: io.ExpertDistributionReqType,
    said: str,
) -> Callable[[], Awaitable[Response]]:
    """A route handler without parameters that calls fn(action, said)."""

    async def handler() -> Response:
        return await fn(action, said)

    return handler
