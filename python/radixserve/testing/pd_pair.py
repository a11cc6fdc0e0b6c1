"""A prefill and a decode Scheduler in this process, stepped by hand, talking over the real
bootstrap server and transfer backend on 127.0.0.1: tests of the disaggregation machinery
without starting servers.

    pair = PDPair(model_path, page_size=16)
    pair.submit("r0", ids, room=7, max_new_tokens=16)      # sent to both sides, as a PD router does
    results = pair.run_until_idle()                         # rid -> Result on the decode side
    pair.close()
"""

from __future__ import annotations

import time
from typing import Any

from radixserve.managers.io_struct import AbortReq, DisaggRouting, TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.testing.inprocess import InProcessScheduler, Result
from radixserve.utils.network import get_free_port


class PDPair:
    def __init__(
        self,
        model_path: str,
        prefill_args: dict[str, Any] | None = None,
        decode_args: dict[str, Any] | None = None,
        backend: str = "tcp",
        **common: Any,
    ) -> None:
        self.bootstrap_port = get_free_port()
        base = {"disable_overlap_schedule": True, "disaggregation_transfer_backend": backend, **common}
        self.prefill = InProcessScheduler(
            model_path,
            disaggregation_mode="prefill",
            disaggregation_bootstrap_port=self.bootstrap_port,
            **{**base, **(prefill_args or {})},
        )
        self.decode = InProcessScheduler(
            model_path, disaggregation_mode="decode", **{**base, **(decode_args or {})}
        )
        self.tokenizer = self.decode.tokenizer

    def message(
        self, rid: str, input_ids: list[int], room: int | None, **params: Any
    ) -> TokenizedGenerateReqInput:
        """`params`: SamplingParams fields, and `return_logprob`, `lora_id` (the adapter both
        sides loaded under that id; the start-up adapters' ids are their names) and `mm_inputs`
        (the prompt's images, a MultimodalPayload: both sides get it, as both tokenize the
        router's request)."""
        params.setdefault("temperature", 0.0)
        return_logprob = params.pop("return_logprob", False)
        lora_id = params.pop("lora_id", None)
        mm_inputs = params.pop("mm_inputs", None)
        sp = SamplingParams(**params)
        sp.normalize()
        sp.verify(self.decode.worker.info.vocab_size)
        return TokenizedGenerateReqInput(
            rid,
            "",
            list(input_ids),
            sp,
            return_logprob=return_logprob,
            routing=DisaggRouting("127.0.0.1", self.bootstrap_port, room),
            lora_id=lora_id,
            mm_inputs=mm_inputs,
        )

    def submit(self, rid: str, input_ids: list[int], room: int, **params: Any) -> None:
        msg = self.message(rid, input_ids, room, **params)
        self.prefill.scheduler.process_input_requests([msg])
        self.decode.scheduler.process_input_requests([msg])

    def abort(self, rid: str, side: str = "both") -> None:
        for name in ("prefill", "decode") if side == "both" else (side,):
            getattr(self, name).scheduler.process_input_requests([AbortReq(rid=rid)])

    def step(self) -> None:
        self.prefill.step()
        self.decode.step()

    def idle(self) -> bool:
        return self.prefill.scheduler.is_idle() and self.decode.scheduler.is_idle()

    def run_until_idle(self, timeout_s: float = 120.0) -> dict[str, Result]:
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the pair did not become idle: prefill {self.prefill.scheduler.get_internal_state()}"
                    f" decode {self.decode.scheduler.get_internal_state()}"
                )
            self.step()
        self.decode.run_until_idle()  # decodes the text of the results
        return self.decode.results

    def check_memory_leak(self) -> str | None:
        problems = [f"{n}: {p}" for n in ("prefill", "decode") if (p := getattr(self, n).check_memory_leak())]
        return "; ".join(problems) or None

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
