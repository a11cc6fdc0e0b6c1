"""Poison-request quarantine: with --restart-on-failure, a request that was in flight at two
crashes of the server's children is refused afterwards instead of crashing it again.

A dead process cannot say which request killed it, so every request in flight at a crash is a
suspect and gets a strike, keyed by a hash of what decides its computation (the token ids and
the sampling parameters; not the rid, which a retrying client changes). A request that later
finishes normally clears its key's strikes: it cannot be the one that kills the server, so an
innocent bystander of one crash is forgiven as soon as its retry succeeds. At STRIKES strikes the
key is quarantined until the server process exits. Both tables are bounded (oldest out first).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import orjson

from radixserve.managers.input_validation import InvalidRequestError
from radixserve.managers.io_struct import TokenizedEmbeddingReqInput, TokenizedGenerateReqInput

logger = logging.getLogger(__name__)

STRIKES = 2  # crashes a request may be in flight at before it is refused
MAX_KEYS = 10_000  # each table's bound: a key is 64 hex characters

TokenizedReq = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput


class QuarantinedRequestError(InvalidRequestError):
    """The request crashed the server before (HTTP 400: retrying it as is cannot succeed)."""


def request_key(req: TokenizedReq) -> str:
    """sha256 of the request's computation: token ids, sampling parameters, logprob options."""
    if isinstance(req, TokenizedGenerateReqInput):
        what: Any = [
            req.input_ids,
            req.sampling_params.to_dict(),
            req.return_logprob,
            req.logprob_start_len,
            req.top_logprobs_num,
        ]
    else:
        what = [req.input_ids, req.token_type_ids, req.label_token_ids]
    blob = orjson.dumps(what, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY, default=str)
    return hashlib.sha256(blob).hexdigest()


class Quarantine:
    """Strikes per request key; runs on the TokenizerManager's event loop only."""

    def __init__(self, strikes: int = STRIKES, max_keys: int = MAX_KEYS) -> None:
        self.strikes_needed = strikes
        self.max_keys = max_keys
        self._in_flight: dict[str, str] = {}  # rid -> key, for requests the scheduler was sent
        self._strikes: OrderedDict[str, int] = OrderedDict()
        self._refused: OrderedDict[str, None] = OrderedDict()

    def admit(self, reqs: Iterable[TokenizedReq]) -> None:
        """Raise QuarantinedRequestError if any request is quarantined; else track them all."""
        keyed = [(req.rid, request_key(req)) for req in reqs]
        for rid, key in keyed:
            if key in self._refused:
                logger.warning("Refused quarantined request %s (key %s)", rid, key[:12])
                raise QuarantinedRequestError(
                    f"This request was in flight at {self.strikes_needed} crashes of the server's "
                    "scheduler and is refused so it cannot crash it again (poison-request "
                    "quarantine, docs/reliability.md). Change the prompt or the sampling parameters, "
                    "or report it to the operator."
                )
        self._in_flight.update(keyed)

    def finished(self, rid: str, ok: bool) -> None:
        """A request ended; `ok` (not aborted) clears its key's strikes."""
        key = self._in_flight.pop(rid, None)
        if key is not None and ok:
            self._strikes.pop(key, None)

    def on_crash(self) -> list[str]:
        """A child died: one strike for each request in flight; returns the keys now refused."""
        newly: list[str] = []
        for key in dict.fromkeys(self._in_flight.values()):  # admission order: oldest out first
            count = self._strikes.pop(key, 0) + 1
            if count >= self.strikes_needed:
                self._refused[key] = None
                _trim(self._refused, self.max_keys)
                newly.append(key)
            else:
                self._strikes[key] = count
                _trim(self._strikes, self.max_keys)
        self._in_flight.clear()
        if newly:
            logger.error(
                "Quarantined %d request(s) in flight at %d crashes: keys %s",
                len(newly),
                self.strikes_needed,
                [k[:12] for k in newly],
            )
        return newly


def _trim(table: OrderedDict[str, Any], bound: int) -> None:
    while len(table) > bound:
        table.popitem(last=False)
