"""`radixserve.Engine`: the server's processes without HTTP, for offline use.

The scheduler(s) and the detokenizer run as child processes exactly as under launch_server; the
TokenizerManager runs on a private event loop in a daemon thread, so `generate` works from plain
synchronous code and `async_generate` from any other event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from radixserve.entrypoints.subprocesses import SchedulerEntry, launch_subprocesses, resolve_model_path
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager, load_tokenizer
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs

DEFAULT_MAX_NEW_TOKENS = SamplingParams().max_new_tokens

T = TypeVar("T")
Prompt = str | list[str] | None
Params = dict[str, Any] | SamplingParams | list[dict[str, Any] | SamplingParams] | None


class Engine:
    """`Engine(model_path=..., **server_args)`; `generate(prompt, sampling_params)`; `shutdown()`.

    Results are dicts {"text", "output_ids", "meta_info"} (a list, in input order, for a batch or
    n > 1). Streaming yields the same dicts with the text so far, one per progress of any item.
    """

    def __init__(
        self, model_path: str | None = None, scheduler_entry: SchedulerEntry | None = None, **kwargs: Any
    ) -> None:
        self.server_args = resolve_model_path(ServerArgs(model_path=model_path, **kwargs).resolve())
        self._port_args = PortArgs.create()
        self._children, info = launch_subprocesses(self.server_args, self._port_args, scheduler_entry)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(
            self.server_args, self._port_args, info, load_tokenizer(self.server_args)
        )
        self._run(self.tokenizer_manager.start())
        self._children.start_watchdog(self._on_child_death)
        self._closed = False

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        obj = _request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
        )
        if stream:
            return self._sync_stream(obj)
        return self._run(self.tokenizer_manager.generate(obj))

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        obj = _request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
        )
        if stream:
            return self._async_stream(obj)
        future = asyncio.run_coroutine_threadsafe(self.tokenizer_manager.generate(obj), self._loop)
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Stop the children and the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.tokenizer_manager.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._children.terminate()
            self._port_args.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _open_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        return await self.tokenizer_manager.stream(obj)  # submits on the loop thread (ZMQ is single-threaded)

    def _sync_stream(self, obj: GenerateReqInput) -> Iterator[dict]:
        agen = self._run(self._open_stream(obj))
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    async def _async_stream(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        agen = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._open_stream(obj), self._loop))
        try:
            while True:
                try:
                    fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop))

    def _on_child_death(self, name: str, exitcode: int | None) -> None:
        self._loop.call_soon_threadsafe(
            self.tokenizer_manager.fail_all, f"{name} died (exit code {exitcode})", 503
        )


def _request(
    prompt: Prompt,
    sampling_params: Params,
    input_ids: list[int] | list[list[int]] | None,
    return_logprob: bool,
    logprob_start_len: int | None,
    top_logprobs_num: int | None,
    return_text_in_logprobs: bool,
) -> GenerateReqInput:
    def as_dict(p: dict[str, Any] | SamplingParams) -> dict[str, Any]:
        if not isinstance(p, SamplingParams):
            return dict(p)
        d = p.to_dict()
        # An object cannot tell a max_new_tokens the caller set from its default: the default
        # counts as unset, so it shrinks to fit a long prompt as an omitted dict key does.
        if d["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS:
            del d["max_new_tokens"]
        return d

    params: Any = sampling_params
    if isinstance(params, list):
        params = [as_dict(p) for p in params]
    elif params is not None:
        params = as_dict(params)
    return GenerateReqInput(
        text=prompt,
        input_ids=input_ids,
        sampling_params=params,
        return_logprob=return_logprob,
        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
        top_logprobs_num=top_logprobs_num or 0,
        return_text_in_logprobs=return_text_in_logprobs,
    )
