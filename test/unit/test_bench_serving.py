"""bench_serving: metric arithmetic, datasets, arrivals, and full runs against a fake SSE server."""

import asyncio
import json
import math
import random
import threading

import numpy as np
import pytest
from aiohttp import web

from radixserve.bench_serving import arrival_times, main
from radixserve.benchmark_utils import datasets as ds
from radixserve.benchmark_utils.backends import _sse_payloads, merge_body
from radixserve.benchmark_utils.metrics import RequestFuncOutput, calculate_metrics, format_report

# ----------------------------------------------------------------------------- metrics


def _outputs() -> list[RequestFuncOutput]:
    return [
        RequestFuncOutput(success=True, latency=1.0, ttft=0.2, itl=[0.1, 0.3], prompt_len=10, output_len=5),
        RequestFuncOutput(success=True, latency=2.0, ttft=0.4, itl=[0.2], prompt_len=20, output_len=3),
        RequestFuncOutput(success=True, latency=0.5, ttft=0.5, itl=[], prompt_len=5, output_len=1),
        RequestFuncOutput(
            success=False, latency=9.0, ttft=9.0, itl=[5.0], prompt_len=100, output_len=50, error="boom"
        ),
    ]


def test_calculate_metrics_hand_computed():
    m = calculate_metrics(_outputs(), duration=4.0)
    assert (m.completed, m.failed, m.errors) == (3, 1, ["boom"])
    assert (m.total_input, m.total_output) == (35, 9)  # the failed request's tokens are excluded
    assert m.request_throughput == pytest.approx(0.75)
    assert m.input_throughput == pytest.approx(8.75)
    assert m.output_throughput == pytest.approx(2.25)
    assert m.total_throughput == pytest.approx(11.0)
    assert m.concurrency == pytest.approx(3.5 / 4.0)
    # TTFT [0.2, 0.4, 0.5]: p99 rank 1.98 -> 0.4 + 0.98 * 0.1
    assert m.mean_ttft_ms == pytest.approx(1100 / 3)
    assert m.median_ttft_ms == pytest.approx(400)
    assert m.p99_ttft_ms == pytest.approx(498)
    # ITL pooled over requests: [0.1, 0.3, 0.2]
    assert m.mean_itl_ms == pytest.approx(200)
    assert m.median_itl_ms == pytest.approx(200)
    assert m.p95_itl_ms == pytest.approx(290)
    assert m.p99_itl_ms == pytest.approx(298)
    assert m.max_itl_ms == pytest.approx(300)
    # TPOT (e2e - ttft) / (out - 1): 0.8/4 = 0.2, 1.6/2 = 0.8; the 1-token request has none.
    assert m.mean_tpot_ms == pytest.approx(500)
    assert m.median_tpot_ms == pytest.approx(500)
    assert m.p99_tpot_ms == pytest.approx(200 + 0.99 * 600)
    # E2E [0.5, 1, 2]
    assert m.mean_e2e_latency_ms == pytest.approx(3500 / 3)
    assert m.median_e2e_latency_ms == pytest.approx(1000)
    assert m.p99_e2e_latency_ms == pytest.approx(1980)


def test_calculate_metrics_all_failed_is_all_zero():
    m = calculate_metrics([RequestFuncOutput(error="refused")], duration=0.0)
    assert (m.completed, m.failed, m.total_output) == (0, 1, 0)
    assert m.request_throughput == m.mean_ttft_ms == m.p99_itl_ms == m.concurrency == 0.0


def test_format_report_has_the_block_and_errors():
    text = format_report(calculate_metrics(_outputs(), 4.0), {"Backend": "radixserve"})
    assert " Serving Benchmark Result " in text.splitlines()[0]
    assert "Successful requests:" in text and "P95 ITL (ms):" in text and "Concurrency:" in text
    assert "Failed requests:" in text and "- boom" in text


def test_sse_payloads_keep_partial_lines_and_merge_body():
    payloads, rest = _sse_payloads(bytearray(b'data: {"a": 1}\n\n: comment\ndata: [DO'))
    assert payloads == ['{"a": 1}'] and rest == b"data: [DO"
    payloads, rest = _sse_payloads(rest + b"NE]\n\n")
    assert payloads == ["[DONE]"] and rest == b""
    body = merge_body(
        {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "stream": True},
        {"sampling_params": {"top_k": 5}, "rid": "x"},
    )
    assert body == {
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "top_k": 5},
        "stream": True,
        "rid": "x",
    }


# ----------------------------------------------------------------------------- datasets


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")


def test_random_ids_lengths_honour_range_ratio():
    choices = ds.vocab_choices(100, special_ids=[0, 1])
    rows = ds.gen_random_ids(random.Random(0), 300, 40, 20, 0.5, choices)
    assert all(20 <= r.prompt_len == len(r.prompt) <= 40 for r in rows)
    assert all(10 <= r.output_len <= 20 for r in rows)
    assert {r.prompt_len for r in rows} >= {20, 40}  # both ends reachable
    assert all(0 not in r.prompt and 1 not in r.prompt for r in rows)
    exact = ds.gen_random_ids(random.Random(0), 10, 17, 9, 1.0, choices)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(17, 9)}


def test_shared_prefix_groups_share_exact_prefix():
    choices = ds.vocab_choices(1000)
    rows = ds.gen_shared_prefix(random.Random(1), 3, 4, 32, 8, 7, choices)
    assert len(rows) == 12 and all(r.prompt_len == 40 and r.output_len == 7 for r in rows)
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(tuple(r.prompt[:32]), []).append(r.prompt[32:])
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4]
    assert all(len({tuple(q) for q in qs}) == 4 for qs in groups.values())


def test_shared_prefix_as_text_shares_string_prefix():
    tok = _tiny_tokenizer()
    choices = ds.vocab_choices(tok.vocab_size, tok.all_special_ids)
    rows = ds.gen_shared_prefix(random.Random(2), 2, 3, 10, 4, 5, choices, tok, as_text=True)
    prefixes = {r.prompt.split("\n")[0] for r in rows}
    assert len(prefixes) == 2 and all(len(p.split()) == 10 for p in prefixes)
    assert all(r.prompt_len == 14 for r in rows)


def test_sharegpt_loader_reads_and_filters(tmp_path):
    conv = lambda h, g: {"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}  # noqa: E731
    data = [
        conv("w1 w2 w3 w4 w5", "w6 w7 w8 w9"),
        conv("w1 w2", "w3 w4 w5 w6"),  # prompt too short: skipped
        {"conversations": [{"from": "human", "value": "w1 w2 w3 w4"}]},  # no reply: skipped
        conv("w1 w2 w3 w4 w5 w6", "w1 w2 w3 w4 w5 w6 w7"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rows = ds.load_sharegpt(str(path), 5, _tiny_tokenizer(), random.Random(0))
    assert sorted((r.prompt_len, r.output_len) for r in rows) == [(5, 4), (6, 7)]
    fixed = ds.load_sharegpt(str(path), 1, _tiny_tokenizer(), random.Random(0), fixed_output_len=32)
    assert len(fixed) == 1 and fixed[0].output_len == 32


# ----------------------------------------------------------------------------- arrivals


def test_arrivals_infinite_rate_has_no_waits():
    assert arrival_times(50, math.inf, np.random.default_rng(0)) == [0.0] * 50


def test_arrivals_poisson_mean_gap():
    times = arrival_times(20000, 8.0, np.random.default_rng(7))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)  # exponential: std == mean


# ----------------------------------------------------------------------------- fake server


class FakeServer:
    """/generate and /v1/(chat/)completions streaming fixed tokens with a fixed delay per chunk."""

    def __init__(self, delay: float = 0.004, tokens_per_chunk: int = 2, fail_every: int = 0) -> None:
        self.delay, self.tokens_per_chunk, self.fail_every = delay, tokens_per_chunk, fail_every
        self.bodies: list[dict] = []
        self.transports: list = []  # held, so identities stay unique: one entry per connection

    def note(self, request: web.Request, body: dict) -> bool:
        """Record the request; True if this one should fail."""
        self.bodies.append(body)
        if not any(t is request.transport for t in self.transports):
            self.transports.append(request.transport)
        return self.fail_every > 0 and len(self.bodies) % self.fail_every == 0

    async def sse(self, request: web.Request, chunks: list[dict]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await asyncio.sleep(self.delay)
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.note(request, body):
            return web.json_response({"error": "injected failure"}, status=500)
        n = body["sampling_params"]["max_new_tokens"]
        counts = list(range(self.tokens_per_chunk, n, self.tokens_per_chunk)) + [n]
        chunks = [{"text": "x" * c, "meta_info": {"completion_tokens": c}} for c in counts]
        if not body.get("stream"):
            return web.json_response(chunks[-1])
        return await self.sse(request, chunks)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.note(request, body):
            return web.json_response({"error": "injected failure"}, status=500)
        n = body["max_tokens"]
        chat = request.path.endswith("/chat/completions")
        piece = (lambda: {"delta": {"content": "y"}}) if chat else (lambda: {"text": "y"})
        chunks = [{"choices": [piece()]} for _ in range(n)]
        chunks.append({"choices": [], "usage": {"completion_tokens": n}})
        return await self.sse(request, chunks)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/nonexistent/fake-model"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/v1/models", self.models)
        return app


@pytest.fixture
def serve():
    """serve(FakeServer(...)) -> base URL; the server runs on its own loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = []

    async def start(server: FakeServer) -> str:
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield lambda server: asyncio.run_coroutine_threadsafe(start(server), loop).result(10)
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _argv(url: str, *extra: str) -> list[str]:
    return ["--base-url", url, "--disable-tqdm", "--random-vocab-size", "100", *extra]


def test_e2e_radixserve_counts_tokens_and_opens_a_connection_per_request(serve, tmp_path, capsys):
    fake = FakeServer(tokens_per_chunk=2)
    url = serve(fake)
    out_file = tmp_path / "results.jsonl"
    args = [
        "--backend",
        "radixserve",
        "--num-prompts",
        "8",
        "--random-input-len",
        "12",
        "--random-output-len",
        "5",
    ]
    args += ["--random-range-ratio", "1.0", "--max-concurrency", "3", "--output-file", str(out_file)]
    m = main(_argv(url, *args))
    assert (m.completed, m.failed, m.total_input, m.total_output) == (8, 0, 96, 40)
    assert len(fake.bodies) == 9 and len(fake.transports) == 9  # 1 warm-up + 8, no reuse
    body = fake.bodies[-1]
    assert len(body["input_ids"]) == 12 and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    # The first chunk waits `delay` on the server, so no TTFT can be shorter. The gaps between
    # chunks have no lower bound on the client: a client scheduled late reads two chunks at once.
    assert m.mean_ttft_ms >= 4.0 and m.mean_itl_ms >= 0.0 and m.p99_itl_ms >= m.median_itl_ms
    assert m.mean_tpot_ms > 0 and 0 < m.concurrency <= 3.0 + 1e-6
    assert "Serving Benchmark Result" in capsys.readouterr().out
    record = json.loads(out_file.read_text().splitlines()[-1])
    assert record["total_output"] == 40 and record["args"]["backend"] == "radixserve"
    assert isinstance(record["seed"], int) and "p99_ttft_ms" in record
    # Per request, in dataset order: lengths and timings that add up to the report's numbers.
    assert record["input_lens"] == [12] * 8 and record["output_lens"] == [5] * 8
    assert all(0 < t <= lat for t, lat in zip(record["ttfts"], record["latencies"]))
    # 5 tokens in chunks of 2, 2, 1 -> 2 gaps per request, and the timings add up.
    assert [len(gaps) for gaps in record["itls"]] == [2] * 8
    for ttft, gaps, lat in zip(record["ttfts"], record["itls"], record["latencies"]):
        assert min(gaps) >= 0 and ttft + sum(gaps) <= lat + 1e-5
    assert 1e3 * sum(record["ttfts"]) / 8 == pytest.approx(m.mean_ttft_ms, rel=1e-3)
    assert len(record["start_times"]) == 8 and min(record["start_times"]) >= 0


def test_e2e_openai_poisson_seeded_and_failures_reported(serve, capsys):
    fake = FakeServer(fail_every=4)  # requests 4 and 8 of 9 fail (the warm-up is #1)
    url = serve(fake)
    args = [
        "--backend",
        "openai",
        "--num-prompts",
        "8",
        "--random-input-len",
        "6",
        "--random-output-len",
        "4",
    ]
    args += ["--random-range-ratio", "1.0", "--request-rate", "200", "--seed", "3", "--tokenizer", "none"]
    m = main(_argv(url, *args, "--extra-request-body", '{"top_k": 1}'))
    assert (m.completed, m.failed, m.total_output) == (6, 2, 24)
    assert all("HTTP 500" in e and "injected failure" in e for e in m.errors)
    assert len(fake.transports) == 9
    body = fake.bodies[1]
    assert body["model"] == "fake-model" and body["ignore_eos"] is True and body["top_k"] == 1
    assert body["stream_options"] == {"include_usage": True} and len(body["prompt"]) == 6
    assert "First 2 of 2 errors" in capsys.readouterr().out
    # The same --seed gives the same prompts; no seed gives fresh ones.
    again = FakeServer()
    main(_argv(serve(again), *args))
    assert [b["prompt"] for b in again.bodies[1:]] == [b["prompt"] for b in fake.bodies[1:]]
    fresh = FakeServer()
    main(_argv(serve(fresh), *args[:-4]))
    assert [b["prompt"] for b in fresh.bodies[1:]] != [b["prompt"] for b in fake.bodies[1:]]


def test_e2e_chat_text_prompts_and_non_streaming(serve, tmp_path):
    tok_dir = tmp_path / "tok"
    _tiny_tokenizer().save_pretrained(tok_dir)
    fake = FakeServer()
    url = serve(fake)
    args = [
        "--backend",
        "openai-chat",
        "--tokenizer",
        str(tok_dir),
        "--dataset-name",
        "generated-shared-prefix",
    ]
    args += ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "6"]
    args += ["--gsp-question-len", "3", "--gsp-output-len", "4", "--warmup-requests", "0"]
    m = main(_argv(url, *args))
    assert (m.completed, m.total_input, m.total_output) == (4, 36, 16)
    assert all(isinstance(b["messages"][0]["content"], str) for b in fake.bodies)
    plain = FakeServer(tokens_per_chunk=3)
    url = serve(plain)
    args = [
        "--backend",
        "radixserve",
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "7",
    ]
    m = main(_argv(url, *args, "--random-range-ratio", "1.0", "--disable-stream", "--tokenizer", "none"))
    assert (m.completed, m.total_output, m.mean_itl_ms) == (3, 21, 0.0)
    assert m.mean_ttft_ms == pytest.approx(m.mean_e2e_latency_ms)
