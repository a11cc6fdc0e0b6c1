"""LoRAControl: the scheduler side of /load_lora_adapter and /unload_lora_adapter.

Built from the two objects it uses: the worker's LoRAManager (None without --enable-lora) and the
live requests. The TokenizerManager already refuses new requests for an adapter being unloaded
and waits until none of its requests is in flight (SGLang's order); the check here that no live
request uses it is the scheduler's own guard of the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
)

if TYPE_CHECKING:
    from radixserve.lora.manager import LoRAManager
    from radixserve.scheduler.req import Req

NOT_ENABLED = "LoRA is not enabled: start the server with --enable-lora (docs/lora.md)"


class LoRAControl:
    def __init__(self, manager: LoRAManager | None, live: dict[str, Req]) -> None:
        self.manager = manager
        self.live = live

    def loaded(self) -> dict[str, str]:
        """{name: path} of the loaded adapters."""
        if self.manager is None:
            return {}
        return {a.name: a.path for a in self.manager.adapters.values()}

    def load(self, msg: LoadLoRAAdapterReqInput) -> LoadLoRAAdapterReqOutput:
        if self.manager is None:
            return LoadLoRAAdapterReqOutput(False, NOT_ENABLED)
        try:
            self.manager.load_adapter(msg.lora_id, msg.lora_path, name=msg.lora_name)
        except ValueError as e:  # LoRAError: the reason, for a 400
            return LoadLoRAAdapterReqOutput(False, str(e), self.loaded())
        return LoadLoRAAdapterReqOutput(True, "", self.loaded())

    def unload(self, msg: UnloadLoRAAdapterReqInput) -> UnloadLoRAAdapterReqOutput:
        if self.manager is None:
            return UnloadLoRAAdapterReqOutput(False, NOT_ENABLED)
        users = [r.rid for r in self.live.values() if r.lora_id == msg.lora_id]
        if users:
            message = (
                f"LoRA adapter {msg.lora_name!r} is in use by {len(users)} request(s), e.g. {users[0]!r}"
            )
            return UnloadLoRAAdapterReqOutput(False, message, self.loaded())
        try:
            self.manager.unload_adapter(msg.lora_id)
        except ValueError as e:
            return UnloadLoRAAdapterReqOutput(False, str(e), self.loaded())
        return UnloadLoRAAdapterReqOutput(True, "", self.loaded())
