"""Prefill/decode disaggregation (docs/disaggregation.md, seed INVENTORY §33).

A prefill server computes each prompt's KV and first token and sends them to a decode server,
which decodes to the end; a load balancer (sglang-router --pd-disaggregation, or mini_lb here)
sends every request to both with the same `bootstrap_room`.

- utils: the modes, KVPoll and the forward-only status every transfer keeps.
- bootstrap_server: the prefill side's HTTP rendezvous (PUT/GET /route, /health).
- tcp_backend / fake_backend: KV senders (prefill) and receivers (decode).
- prefill: PrefillBootstrapQueue and the inflight queue, as hooks of the scheduler's loop.
- decode: DecodePreallocQueue, DecodeTransferQueue and PREBUILT batches, as hooks of the loop.
"""
