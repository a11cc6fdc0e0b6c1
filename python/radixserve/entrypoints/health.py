"""/health_generate: is the model still producing outputs?

As SGLang's: a server that is producing outputs is healthy, whatever its load, so a load balancer
does not take a busy server for a dead one. An output from the scheduler within RECENT_OUTPUT_S
answers at once, with no probe; otherwise a 1-token probe request is sent, and the check passes
when it (or any other request) produces an output within HEALTH_GENERATE_TIMEOUT_S. SGLang counts
any message from the scheduler; only outputs count here, so a server whose generation is paused
(which still answers control requests) is reported unhealthy, as before.
"""

from __future__ import annotations

import asyncio
import time

from radixserve.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from radixserve.entrypoints.openai.serving_common import raise_if_failed
from radixserve.managers import scoring
from radixserve.managers.embedding_request import make_item
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.tokenizer_manager import RequestAbortedError, TokenizerManager

HEALTH_GENERATE_TIMEOUT_S = 20.0
RECENT_OUTPUT_S = 1.0  # an output this recent proves progress: no probe
POLL_S = 0.1  # how often a waiting check looks for outputs of other requests


async def generation_failure(tm: TokenizerManager) -> str | None:
    """None when the scheduler produced an output recently or during the check, else why not."""
    started = time.monotonic()
    if started - tm.last_output_time < RECENT_OUTPUT_S:
        return None
    probe = asyncio.ensure_future(_probe(tm))
    try:
        while True:
            done, _ = await asyncio.wait({probe}, timeout=POLL_S)
            if done:
                return _probe_failure(probe)
            if tm.last_output_time > started:  # another request progressed: the probe may wait
                return None
            if time.monotonic() - started > HEALTH_GENERATE_TIMEOUT_S:
                return f"No output within {HEALTH_GENERATE_TIMEOUT_S:.0f} s."
    finally:
        probe.cancel()  # a probe still queued is aborted (TokenizerManager.generate's cleanup)


def _probe_failure(probe: asyncio.Future[None]) -> str | None:
    try:
        probe.result()
    except RequestAbortedError as exc:  # refused (queue full, waiting timeout), a child died
        return f"Generation failed: {exc!r}"
    return None


async def _probe(tm: TokenizerManager) -> None:
    if not tm.is_generation:  # a model that cannot generate is probed with one embedding
        await scoring.run(tm, [make_item([0])], None)
        return
    probe = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    probe._health_check = True  # a busy scheduler answers it with its next batch, never queues it
    if tm.server_args.disaggregation_mode != "null":
        # One half of a PD pair has no peer for a probe: the fake host moves no KV (as SGLang).
        probe.bootstrap_host, probe.bootstrap_room = FAKE_BOOTSTRAP_HOST, 0
    raise_if_failed(await tm.generate(probe))  # type: ignore[arg-type]
