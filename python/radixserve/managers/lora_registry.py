"""The TokenizerManager's LoRA adapters: which names requests may use, and load / unload.

A request names an adapter (`lora_path` on /generate and Engine.generate, `model: "base:adapter"`
on the OpenAI routes); this registry turns the name into the id of the adapter's current load,
which travels on the request (`lora_id`) and is the radix cache's namespace. A name loaded again
gets a new id, so its requests never meet KV the old adapter computed.

Unloading is SGLang's order: the name is dropped at once (new requests for it are refused with
400), the unload waits until no request that uses the adapter is in flight, then the scheduler
drops the weights. So an unload never fails a running request; it waits for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.generate_request import RequestItem
from radixserve.managers.input_validation import InvalidRequestError

UNLOAD_POLL_S = 0.01  # how often an unload looks whether the adapter's requests are done


@dataclasses.dataclass(frozen=True)
class LoadedLoRA:
    path: str
    lora_id: str


class LoRARegistry:
    def __init__(
        self,
        server_args: Any,  # noqa: ANN401 - a resolved ServerArgs
        ask: Callable[[io.ControlReq], Awaitable[Any]],
        live_lora_ids: Callable[[], Iterable[str | None]],
    ) -> None:
        from radixserve.lora.adapter import parse_lora_paths

        self.enabled = bool(server_args.enable_lora)
        # Adapters loaded at start are named by their name, as the scheduler loaded them.
        self.adapters = {n: LoadedLoRA(p, n) for n, p in parse_lora_paths(server_args.lora_paths).items()}
        self._ask = ask
        self._live_lora_ids = live_lora_ids

    def loaded(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    def resolve(self, items: list[RequestItem]) -> list[RequestItem]:
        """Each item with its adapter's id; InvalidRequestError (400) for an adapter this server
        does not serve."""
        if all(item.lora_path is None for item in items):
            return items
        if not self.enabled:
            raise InvalidRequestError(
                f"lora_path {items[0].lora_path!r} was given, but this server was started without "
                "--enable-lora (docs/lora.md)."
            )
        out = []
        for item in items:
            if item.lora_path is None:
                out.append(item)
                continue
            loaded = self.adapters.get(item.lora_path)
            if loaded is None:
                raise InvalidRequestError(
                    f"Unknown LoRA adapter {item.lora_path!r}; loaded: {sorted(self.adapters) or 'none'}."
                )
            out.append(dataclasses.replace(item, lora_id=loaded.lora_id))
        return out

    async def load(self, name: str, path: str, pinned: bool = False) -> io.LoadLoRAAdapterReqOutput:
        if not self.enabled:
            return io.LoadLoRAAdapterReqOutput(
                False, "LoRA is not enabled: start the server with --enable-lora."
            )
        if not name or ":" in name:
            return io.LoadLoRAAdapterReqOutput(False, f"lora_name {name!r} must be non-empty, without ':'.")
        if name in self.adapters:
            return io.LoadLoRAAdapterReqOutput(
                False, f"LoRA adapter {name!r} is already loaded.", self.loaded()
            )
        lora_id = f"{name}@{uuid.uuid4().hex[:12]}"
        out = await self._ask(io.LoadLoRAAdapterReqInput(name, path, lora_id, pinned))
        if out.success:
            self.adapters[name] = LoadedLoRA(path, lora_id)
        else:
            # With --dp-size > 1 a replica may have loaded it while another refused: no request
            # can reach this id, so drop it wherever it was loaded (the others answer "unknown").
            await self._ask(io.UnloadLoRAAdapterReqInput(name, lora_id))
        return dataclasses.replace(out, loaded_adapters=self.loaded())

    async def unload(self, name: str) -> io.UnloadLoRAAdapterReqOutput:
        loaded = self.adapters.pop(name, None)  # from now on its new requests are refused
        if loaded is None:
            return io.UnloadLoRAAdapterReqOutput(
                False, f"LoRA adapter {name!r} is not loaded.", self.loaded()
            )
        while loaded.lora_id in set(self._live_lora_ids()):
            await asyncio.sleep(UNLOAD_POLL_S)
        out = await self._ask(io.UnloadLoRAAdapterReqInput(name, loaded.lora_id))
        if not out.success:  # the scheduler kept it: so does the name
            self.adapters[name] = loaded
        return dataclasses.replace(out, loaded_adapters=self.loaded())
