"""The dashboard's routes: the page and its files, and /dashboard/state (docs/observability.md).

None is in /openapi.json: the page is not an API, and /dashboard/state is the page's own feed
(its fields may change with the page). --disable-dashboard leaves every one of them out (404).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Query
from fastapi.responses import Response

from radixserve.entrypoints.dashboard.assets import ASSETS, SECURITY_HEADERS, read_asset
from radixserve.entrypoints.dashboard.state import DEFAULT_ROWS, MAX_ROWS, dashboard_state
from radixserve.entrypoints.dashboard.window import MetricsWindow
from radixserve.entrypoints.http_guards import error_response

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState


def add_dashboard_routes(app: FastAPI, state: ServerState) -> None:
    if state.tm.server_args.disable_dashboard:
        return
    for path, (name, media_type) in ASSETS.items():
        _add_asset_route(app, path, name, media_type)
    window = MetricsWindow()  # shared by every open page: one snapshot per half second at most
    app.state.dashboard_window = window

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state_route(max_rows: int = Query(DEFAULT_ROWS, ge=0, le=MAX_ROWS)) -> Response:
        if state.dead:
            return error_response(503, "A server process died.")
        if state.restarting or not state.ready:
            return error_response(503, "The server is starting.")
        body = await dashboard_state(state.tm, window, max_rows)
        return Response(
            orjson.dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"}
        )


def _add_asset_route(app: FastAPI, path: str, name: str, media_type: str) -> None:
    async def asset() -> Response:
        return Response(read_asset(name), media_type=media_type, headers=SECURITY_HEADERS)

    app.get(path, include_in_schema=False, name=f"dashboard_{name}")(asset)
