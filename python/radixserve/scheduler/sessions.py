"""Sessions (seed 002 §6.1, INVENTORY §26): multi-turn requests that continue earlier ones.

A session keeps, per request id, the request and the branch it continued from (a tree: `replace`
starts a new branch at a request and drops that request's later branches). A generate request
with `session_params` {id, rid} is built from rid's whole history, its prompt and its output
(or its prompt alone with `drop_previous_output`, cut to `offset` tokens when given), followed by
the new input, so the radix cache serves the history's KV and only the new turn is computed.

Refusals finish the request at once with an abort (status 400) and the seed's messages; a
session closed while one of its requests is running is deleted when its last request finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from radixserve.managers.io_struct import (
    CloseSessionReqInput,
    ControlOutcome,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.scheduler.req import Req

logger = logging.getLogger(__name__)

BAD_REQUEST = int(HTTPStatus.BAD_REQUEST)


@dataclass(eq=False)
class SessionReqNode:
    req: Req
    parent: SessionReqNode | None = None
    children: list[SessionReqNode] = field(default_factory=list)

    def drop_children(self, nodes: dict[str, SessionReqNode], abort: Callable[[Req], None]) -> None:
        """Forget every continuation of this request (aborting the unfinished ones)."""
        for child in self.children:
            child.drop_children(nodes, abort)
            if not child.req.finished():
                abort(child.req)
            if nodes.get(child.req.rid) is child:
                del nodes[child.req.rid]
        self.children = []


@dataclass(eq=False)
class Session:
    session_id: str
    capacity_of_str_len: int
    nodes: dict[str, SessionReqNode] = field(default_factory=dict)
    closing: bool = False

    def has_unfinished(self) -> bool:
        return any(not n.req.finished() for n in self.nodes.values())


class SessionController:
    """The scheduler's sessions. `build` makes a Req from a message and its full input ids;
    `abort` stops a running request (a branch `replace` drops); `reject` finishes a new one."""

    def __init__(
        self,
        build: Callable[[TokenizedGenerateReqInput, list[int]], Req],
        abort: Callable[[Req], None],
        bos_token_id: int | None = None,
    ) -> None:
        self.sessions: dict[str, Session] = {}
        self._build = build
        self._abort = abort
        self._bos = bos_token_id

    # ------------------------------------------------------------------ open / close
    def open(self, msg: OpenSessionReqInput) -> ControlOutcome:
        sid = msg.session_id
        if sid in self.sessions:
            message = f"session id {sid} already exist, cannot open."
            logger.warning(message)
            return ControlOutcome(False, message)
        if sid is None:
            message = "session id is None, cannot open."
            logger.warning(message)
            return ControlOutcome(False, message)
        self.sessions[sid] = Session(sid, msg.capacity_of_str_len)
        return ControlOutcome(True, "")

    def close(self, msg: CloseSessionReqInput) -> ControlOutcome:
        session = self.sessions.get(msg.session_id)
        if session is None or session.closing:
            message = f"session id {msg.session_id} does not exist, cannot delete."
            logger.warning(message)
            return ControlOutcome(False, message)
        if session.has_unfinished():
            session.closing = True  # deleted when its last request finishes (on_finished)
            return ControlOutcome(True, "The session closes when its running request finishes.")
        del self.sessions[msg.session_id]
        return ControlOutcome(True, "")

    def on_finished(self, req: Req) -> None:
        sid = req.session_id
        session = self.sessions.get(sid) if sid is not None else None
        if session is not None and session.closing and not session.has_unfinished():
            del self.sessions[session.session_id]

    # ------------------------------------------------------------------ requests
    def create_req(self, msg: TokenizedGenerateReqInput) -> tuple[Req, str | None]:
        """The request `msg` makes in its session, and the reason to refuse it (None: run it)."""
        params = msg.session_params
        assert params is not None and params.id is not None
        session = self.sessions.get(params.id)
        if session is None or session.closing:
            return self._build(msg, msg.input_ids), f"Invalid request: session id {params.id} does not exist"
        last, error = self._continued_node(session, params)
        if error is not None:
            return self._build(msg, msg.input_ids), error
        input_ids = self._input_ids(msg, params, last.req if last is not None else None)
        req = self._build(msg, input_ids)
        req.session_id = session.session_id
        node = SessionReqNode(req, last)
        if last is not None:
            last.children.append(node)
        session.nodes[req.rid] = node
        return req, None

    def _continued_node(
        self, session: Session, params: SessionParams
    ) -> tuple[SessionReqNode | None, str | None]:
        if params.rid is None:
            if params.replace:  # a new root: every earlier branch goes
                for node in list(session.nodes.values()):
                    node.drop_children(session.nodes, self._abort)
                for node in list(session.nodes.values()):
                    if not node.req.finished():
                        self._abort(node.req)
                session.nodes.clear()
            return None, None
        node = session.nodes.get(params.rid)
        if node is None:
            return None, f"Invalid request: request {params.rid} is not in session {session.session_id}"
        if params.replace:
            if not node.req.finished():
                self._abort(node.req)
            node.drop_children(session.nodes, self._abort)
        elif not node.req.finished():
            logger.warning("The request in a session is appending to a request that hasn't finished.")
            return None, (
                f"Invalid request: request {params.rid} of session {session.session_id} has not finished"
            )
        return node, None

    def _input_ids(
        self, msg: TokenizedGenerateReqInput, params: SessionParams, last: Req | None
    ) -> list[int]:
        new = list(msg.input_ids)
        if last is None:
            return new
        if self._bos is not None and new and new[0] == self._bos:
            new = new[1:]  # an appended turn does not restart the sequence
        history = list(last.origin_input_ids)
        if not params.drop_previous_output:
            history += last.output_ids[: last.sampling_params.max_new_tokens]
        if params.offset:
            history = history[: params.offset]
        return history + new
