"""The scheduler's side of constrained decoding (seed INVENTORY §25): the grammar queue, the
per-step vocab mask and advancing each request's matcher.

- `route(req)`: a request with a grammar waits in the grammar queue until its compilation is done
  (a cache hit with a finished compile goes straight to the waiting queue).
- `move_ready()` (each loop iteration): compiled -> waiting queue with a fresh matcher; failed ->
  finished with the compiler's message (400); past --grammar-compile-timeout -> finished with an
  error; aborted while compiling -> finished with the abort's reason.
- `vocab_mask(reqs)`: a VocabMask (bool [k, vocab], True = allowed, for the k constrained rows) for
  a batch with at least one grammar, None otherwise; unconstrained rows pay nothing in either case.
- `accept_token(req, tok)`: advance the matcher with a kept token; a terminated grammar finishes
  the request ("stop").

The matcher only ever sees tokens the request keeps (dropped tokens of retracted or finished
requests never reach accept_token), so after retraction its state still equals output_ids and the
re-prefill samples its next token from the right state without any rollback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch

from radixserve.constrained.grammar_backend import GrammarBackend, InvalidGrammar, grammar_key
from radixserve.distributed.rank_runtime import LocalSync, RankSync
from radixserve.sampling.vocab_mask import VocabMask
from radixserve.scheduler.req import FinishAbort, FinishMatchedToken, Req

logger = logging.getLogger(__name__)

BackendFactory = Callable[[], GrammarBackend]

# Why constrained requests are refused (HTTP 400) when there is no backend factory.
NO_TOKENIZER = "Constrained decoding is unavailable: the server has no tokenizer."
TURNED_OFF = (
    "Constrained decoding (json_schema / regex / ebnf) is turned off on this server (--grammar-backend none)."
)


@dataclass
class _Pending:
    req: Req
    future: Future[Any]
    since: float  # time.monotonic() when it entered the grammar queue


class GrammarManager:
    def __init__(
        self,
        backend_factory: BackendFactory | None,
        compile_timeout_s: float,
        enqueue: Callable[[Req], None],
        finish_now: Callable[[Req, str, int | None], None],
        sync: RankSync | None = None,
        unavailable_reason: str = NO_TOKENIZER,
    ) -> None:
        """`unavailable_reason`: the 400 message for constrained requests when there is no factory."""
        self._backend_factory = backend_factory
        # Ranks compile on their own threads; whether a compilation is done (or timed out) is
        # agreed over all ranks so every rank's scheduler moves the same requests in the same step.
        self._sync: RankSync = sync or LocalSync()
        self._unavailable_reason = unavailable_reason
        self._backend: GrammarBackend | None = None
        self._backend_error: str | None = None
        self.compile_timeout_s = compile_timeout_s
        self._enqueue = enqueue
        self._finish_now = finish_now
        self.grammar_queue: list[_Pending] = []
        self._bitmask: torch.Tensor | None = None  # reused int32 [rows, words] buffer
        self._shifts = torch.arange(32, dtype=torch.int32)  # [32]
        self._batch_matcher: Any = None

    # ------------------------------------------------------------------ backend
    def backend(self) -> GrammarBackend | None:
        """Built on the first constrained request: importing xgrammar takes seconds."""
        if self._backend is None and self._backend_error is None:
            if self._backend_factory is None:
                self._backend_error = self._unavailable_reason
            else:
                try:
                    self._backend = self._backend_factory()
                except Exception as exc:  # missing package, unsupported tokenizer, ...
                    logger.exception("Could not create the grammar backend")
                    self._backend_error = f"Constrained decoding is unavailable: {exc}"
        return self._backend

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()

    # ------------------------------------------------------------------ grammar queue
    def route(self, req: Req) -> None:
        """Enqueue a validated request: straight to the waiting queue, or via the grammar queue."""
        key = grammar_key(req.sampling_params)
        if key is None:
            self._enqueue(req)
            return
        backend = self.backend()
        if backend is None:
            self._finish_now(req, self._backend_error or "no grammar backend", int(HTTPStatus.BAD_REQUEST))
            return
        req.grammar_key = key
        future, _ = backend.get_cached_or_future_value(key)
        # Each rank compiles on its own thread, so one may find the grammar done while another
        # does not: agree, or the ranks' grammar queues (and the collectives move_ready makes only
        # while its queue is not empty) diverge.
        (done,) = self._sync.all_agree([future.done()])
        if done:
            self._resolve(req, future)
        else:
            self.grammar_queue.append(_Pending(req, future, time.monotonic()))

    def move_ready(self) -> None:
        """Move compiled requests on; finish failed, timed-out and aborted ones."""
        if not self.grammar_queue:
            return
        now = time.monotonic()
        queue = self.grammar_queue
        done = [item.future.done() for item in queue]
        in_time = [now - item.since <= self.compile_timeout_s for item in queue]
        agreed = self._sync.all_agree(done + in_time)
        done, in_time = agreed[: len(queue)], agreed[len(queue) :]
        still: list[_Pending] = []
        for item, is_done, is_in_time in zip(queue, done, in_time):
            req = item.req
            if req.to_finish is not None:  # aborted while compiling
                reason = req.to_finish
                message = reason.message if isinstance(reason, FinishAbort) else "Aborted."
                code = reason.status_code if isinstance(reason, FinishAbort) else None
                self._finish_now(req, message, code)
            elif is_done:
                self._resolve(req, item.future)
            elif not is_in_time:
                message = (
                    f"Grammar compilation timed out after {self.compile_timeout_s:g} s "
                    f"(--grammar-compile-timeout) for {req.grammar_key[0] if req.grammar_key else 'grammar'}."
                )
                logger.warning("%s rid=%s", message, req.rid)
                self._finish_now(req, message, int(HTTPStatus.SERVICE_UNAVAILABLE))
            else:
                still.append(item)
        self.grammar_queue = still

    def _resolve(self, req: Req, future: Future[Any]) -> None:
        compiled = future.result()
        if isinstance(compiled, InvalidGrammar):
            self._finish_now(req, compiled.message, int(HTTPStatus.BAD_REQUEST))
            return
        assert self._backend is not None
        req.grammar = self._backend.new_matcher(compiled)
        self._enqueue(req)

    def has_pending(self) -> bool:
        return bool(self.grammar_queue)

    def queued_reqs(self) -> list[Req]:
        """Requests waiting for their grammar (they count against --max-queued-requests)."""
        return [p.req for p in self.grammar_queue]

    def wait_for_any(self, timeout_s: float) -> None:
        """Block up to timeout_s for a compilation to finish: with nothing else to do the loop
        would otherwise spin and steal the CPU the compiler threads need."""
        futures = [p.future for p in self.grammar_queue]
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ decoding
    def vocab_mask(self, reqs: list[Req], vocab_size: int) -> VocabMask | None:
        """The allowed tokens of the constrained rows of `reqs`, or None when no row is constrained.
        Unconstrained rows are left out, so they cost nothing here or in the sampler."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.is_terminated()]
        if not rows:
            return None
        words = (vocab_size + 31) // 32
        bitmask = self._bitmask_buffer(len(rows), words)  # row j = the j-th constrained request
        matchers = [reqs[i].grammar for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch_matcher_obj().batch_fill_next_token_bitmask(matchers, bitmask, list(range(len(rows))))
        allowed = unpack_bitmask(bitmask, vocab_size, self._shifts)  # [k, vocab]
        return VocabMask(torch.tensor(rows, dtype=torch.int64), allowed)

    def _bitmask_buffer(self, bs: int, words: int) -> torch.Tensor:
        buf = self._bitmask
        if buf is None or buf.shape[0] < bs or buf.shape[1] != words:
            buf = torch.empty((max(bs, 8), words), dtype=torch.int32)  # [rows, words]
            self._bitmask = buf
        return buf[:bs]

    def _batch_matcher_obj(self) -> Any:  # noqa: ANN401 - xgrammar.BatchGrammarMatcher
        if self._batch_matcher is None:
            from radixserve.constrained.grammar_backend import import_xgrammar

            self._batch_matcher = import_xgrammar().BatchGrammarMatcher()
        return self._batch_matcher


def unpack_bitmask(
    bitmask: torch.Tensor, vocab_size: int, shifts: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 [bs, words] (bit j of word w = token 32*w + j) -> bool [bs, vocab_size]."""
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [bs, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def accept_token(req: Req, token_id: int) -> None:
    """Advance req's matcher with a kept token; finish the request when the grammar terminates.

    Both outcomes go through `to_finish`, which check_finished applies right after (an abort
    already pending wins)."""
    grammar = req.grammar
    if grammar is None or req.to_finish is not None:
        return
    if not grammar.accept_token(token_id):
        logger.error("Grammar accept_token failed for req %s (token %d)", req.rid, token_id)
        req.to_finish = FinishAbort(
            f"The grammar rejected token {token_id}; the constrained output is incomplete.",
            int(HTTPStatus.INTERNAL_SERVER_ERROR),
        )
    elif grammar.is_terminated():
        req.to_finish = FinishMatchedToken(token_id)
