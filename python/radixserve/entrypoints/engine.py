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

import numpy as np

from radixserve.entrypoints.healing import RestartHandler
from radixserve.entrypoints.rpc_client import RpcClient
from radixserve.entrypoints.subprocesses import (
    SchedulerEntry,
    import_transformers_before_threads,
    launch_subprocesses,
)
from radixserve.entrypoints.supervisor import RestartBudget, Supervisor
from radixserve.managers import io_struct as io
from radixserve.managers import scoring
from radixserve.managers.control_client import ControlClient
from radixserve.managers.crash_dump import write_crash_dump
from radixserve.managers.decode_tokenizer import decode_spec
from radixserve.managers.embedding_request import EmbeddingReqInput
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.hf_tokenizer import load_tokenizer
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.model_executor.tensor_payload import serialize_named_tensors
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.utils.background import BackgroundCall
from radixserve.utils.network import PortArgs
from radixserve.utils.process import ChildProcesses

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
        self.server_args = ServerArgs(model_path=model_path, **kwargs).resolve()
        self._port_args = PortArgs.create()
        # The tokenizer (seconds of transformers import) loads while the children start.
        import_transformers_before_threads(self.server_args)
        tokenizer = BackgroundCall(load_tokenizer, self.server_args, name="load-tokenizer")
        spec = lambda: decode_spec(tokenizer.result())  # noqa: E731 - also for restarts
        children, info = launch_subprocesses(self.server_args, self._port_args, scheduler_entry, None, spec)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(self.server_args, self._port_args, info, tokenizer.result())
        self._run(self.tokenizer_manager.start())
        # A dead child fails what is in flight with 503; with restart_on_failure=True the children
        # are restarted (docs/reliability.md), else every later call fails the same way.
        self._supervisor = Supervisor(
            children,
            lambda into: launch_subprocesses(self.server_args, self._port_args, scheduler_entry, into, spec),
            RestartBudget.from_args(self.server_args),
        )
        self._supervisor.start(RestartHandler(self.tokenizer_manager, self._loop, self._on_child_death))
        self._rpc = RpcClient(self._port_args.rpc_ipc_name)
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
        session_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_hidden_states: bool | list[bool] = False,
        input_embeds: list[list[float]] | list[list[list[float]]] | None = None,
        cache_salt: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int] | None] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        image_data: str | list[str | list[str] | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        # Every parameter but `stream` is a field of the request, under the same name.
        obj = _request(**{k: v for k, v in locals().items() if k not in ("self", "stream")})
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
        session_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_hidden_states: bool | list[bool] = False,
        input_embeds: list[list[float]] | list[list[list[float]]] | None = None,
        cache_salt: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int] | None] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        image_data: str | list[str | list[str] | None] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        # Every parameter but `stream` is a field of the request, under the same name.
        obj = _request(**{k: v for k, v in locals().items() if k not in ("self", "stream")})
        if stream:
            return self._async_stream(obj)
        future = asyncio.run_coroutine_threadsafe(self.tokenizer_manager.generate(obj), self._loop)
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ control plane
    # SGLang's Engine methods of the same names; the HTTP routes call the same coroutines.
    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        return self._run(self._ctl.open_session(io.OpenSessionReqInput(capacity_of_str_len, session_id)))

    def close_session(self, session_id: str) -> None:
        out = self._run(self._ctl.ask(io.CloseSessionReqInput(session_id)))
        if not out.success:
            raise ValueError(out.message)

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        msg = io.UpdateWeightFromDiskReqInput(
            model_path, load_format, abort_all_requests, flush_cache, weight_version
        )
        return self._outcome(self._ctl.ask(msg))

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """Full (unsharded) tensors by checkpoint name; every TP rank takes its shard. As in
        SGLang, with load_format 'flattened_bucket' `named_tensors` is already the list of
        serialized entries, one per TP rank (docs/rl.md)."""
        if load_format == "flattened_bucket":
            entries = list(named_tensors)
        else:
            entries = [serialize_named_tensors(named_tensors, as_text=False)]
        msg = io.UpdateWeightsFromTensorReqInput(
            entries, load_format, flush_cache, abort_all_requests, weight_version
        )
        return self._outcome(self._ctl.ask(msg))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = io.DEFAULT_WEIGHT_GROUP,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        msg = io.InitWeightsUpdateGroupReqInput(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return self._outcome(self._ctl.ask(msg))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = io.DEFAULT_WEIGHT_GROUP,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        msg = io.UpdateWeightsFromDistributedReqInput(
            names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version
        )
        return self._outcome(self._ctl.ask(msg))

    def destroy_weights_update_group(self, group_name: str = io.DEFAULT_WEIGHT_GROUP) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.DestroyWeightsUpdateGroupReqInput(group_name)))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any] | float:
        out = self._run(self._ctl.get_weights_by_name(io.GetWeightsByNameReqInput(name, truncate_size)))
        if not out.success:
            raise ValueError(out.message)
        param = out.parameter  # an array, or one per replica with --dp-size > 1; lists as SGLang's
        return [_as_list(p) for p in param] if isinstance(param, list) else _as_list(param)

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.ReleaseMemoryOccupationReqInput(tags)))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.ResumeMemoryOccupationReqInput(tags)))

    def pause_generation(self, mode: str = "abort") -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.PauseGenerationReqInput(mode)))

    def continue_generation(self) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.ContinueGenerationReqInput()))

    def start_profile(self, **kwargs: Any) -> tuple[bool, str]:
        """kwargs: output_dir, num_steps, activities, with_stack, record_shapes, profile_id."""
        return self._outcome(self._ctl.ask(io.ProfileReq(io.ProfileReqType.START_PROFILE, **kwargs)))

    def stop_profile(self) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.ProfileReq(io.ProfileReqType.STOP_PROFILE)))

    def start_expert_distribution_record(self) -> tuple[bool, str]:
        return self._expert_distribution(io.ExpertDistributionReqType.START_RECORD)

    def stop_expert_distribution_record(self) -> tuple[bool, str]:
        return self._expert_distribution(io.ExpertDistributionReqType.STOP_RECORD)

    def dump_expert_distribution_record(self) -> tuple[bool, str]:
        """(success, the path of the file written) on TP rank 0's side."""
        return self._expert_distribution(io.ExpertDistributionReqType.DUMP_RECORD)

    def _expert_distribution(self, action: io.ExpertDistributionReqType) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.ExpertDistributionReq(action)))

    def slow_down(self, forward_sleep_time: float | None) -> tuple[bool, str]:
        return self._outcome(self._ctl.ask(io.SlowDownReqInput(forward_sleep_time)))

    def freeze_gc(self) -> None:
        self._run(self._ctl.ask(io.FreezeGCReq()))

    def set_internal_state(self, server_args: dict[str, Any]) -> dict[str, Any]:
        out = self._run(self._ctl.ask(io.SetInternalStateReq(server_args)))
        return {"updated": out.updated, "server_args": out.server_args, "message": out.message}

    def get_internal_state(self) -> dict[str, Any]:
        return self._run(self.tokenizer_manager.get_internal_states())[0]

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache())

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False
    ) -> io.LoadLoRAAdapterReqOutput:
        """Load the PEFT adapter at `lora_path` as `lora_name` while serving (docs/lora.md)."""
        return self._run(self.tokenizer_manager.lora.load(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> io.UnloadLoRAAdapterReqOutput:
        """Unload `lora_name` once its in-flight requests finished; new ones are refused at once."""
        return self._run(self.tokenizer_manager.lora.unload(lora_name))

    def collective_rpc(self, method: str, **kwargs: Any) -> Any:  # noqa: ANN401 - the method's result
        """Call scheduler method `method` over the RPC channel (control_table.handle_rpc)."""
        return self._rpc.call(method, kwargs)

    @property
    def _children(self) -> ChildProcesses:
        """The current children (new ones after a restart)."""
        return self._supervisor.children

    @property
    def _ctl(self) -> ControlClient:
        return self.tokenizer_manager.control

    # ------------------------------------------------------------------ models that do not generate
    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> dict | list[dict]:
        """Embeddings (or a classifier's logits): {"embedding", "meta_info"}, a list for a batch."""
        obj = EmbeddingReqInput(
            text=prompt,
            input_ids=input_ids,
            dimensions=dimensions,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        outputs = self._run(scoring.embed(self.tokenizer_manager, obj.items(), dimensions))
        for out in outputs:  # the documented offline shape: lists of floats (float32 values)
            out["embedding"] = np.asarray(out["embedding"]).tolist()
        return outputs[0] if obj.is_single else outputs

    def score(
        self,
        query: str | list[int] | None,
        items: str | list[str] | list[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """/v1/score offline: per item, the probabilities of `label_token_ids` as the next token."""
        coro = scoring.score(self.tokenizer_manager, query, items, label_token_ids, apply_softmax, item_first)
        return self._run(coro)[0]

    def rerank(self, query: str, documents: list[str], instruct: str | None = None) -> list[float]:
        """One relevance score per document, in the documents' order (higher is more relevant)."""
        scored = self._run(scoring.rerank(self.tokenizer_manager, query, documents, instruct))
        return [s for s, _ in scored]

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
            self._rpc.close()
            self._supervisor.stop()
            self._port_args.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _outcome(self, coro: Coroutine[Any, Any, Any]) -> tuple[bool, str]:
        """SGLang's (success, message) of a control call's *Output message."""
        out = self._run(coro)
        return out.success, out.message

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

    def _on_child_death(self, reason: str) -> None:
        self._loop.call_soon_threadsafe(write_crash_dump, self.tokenizer_manager, reason)  # before fail_all
        self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason, 503)


def _request(
    prompt: Prompt,
    sampling_params: Params,
    logprob_start_len: int | None,
    top_logprobs_num: int | None,
    session_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    **fields: Any,  # the other generate() parameters: request fields of the same name
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
    obj = GenerateReqInput(
        text=prompt,
        sampling_params=params,
        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
        top_logprobs_num=top_logprobs_num or 0,
        **fields,
    )
    # Assigned, not passed to the constructor: pydantic leaves them as given, and the request's
    # own parsing (parse_session_params) reports a malformed value.
    obj.session_params, obj.rid = session_params, rid
    return obj


def _as_list(value: np.ndarray | float) -> list[Any] | float:
    """A weight read back as SGLang's Engine returns it: nested lists of floats (a 0-d one a float)."""
    return value.tolist() if isinstance(value, np.ndarray) else value
