"""A tiny Qwen2.5-VL behind the real server, through the OpenAI chat route: `image_url` parts as
data: URLs, http URLs from an allowed local http.server, and file:// URLs under the allowed folder
give HF's greedy tokens; every bad URL (not allowed, 404, too large, too slow, not an image,
outside the folder) is a 400 with a message, and the server still serves afterwards."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import Server, SharedServers, assert_error

from radixserve.testing.tiny_vlm import IMAGE_PLACEHOLDER, image_data_url, random_image

NUM_NEW = 6
TOO_LARGE = 32 * 2**20 + 1  # one byte past the server's image cap
RELEASE_SLOW = threading.Event()  # the slow route answers only once the tests are done


def _png(seed: int) -> bytes:
    return base64.b64decode(image_data_url(random_image(84, 56, seed=seed)).partition(",")[2])


class _Media(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/cat.png":
            self._send(200, _png(1), "image/png")
        elif self.path == "/big.png":
            self._send(200, b"\0" * TOO_LARGE, "image/png")
        elif self.path == "/text.png":
            self._send(200, b"not an image at all", "image/png")
        elif self.path == "/slow.png":
            RELEASE_SLOW.wait(120)  # past any fetch timeout; released at teardown
            self._send(200, _png(1), "image/png")
        else:
            self._send(404, b"missing", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on this fetch (too large): what the test wants

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        RELEASE_SLOW.set()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def local_dir(vlm_local_media: Path) -> Path:
    return vlm_local_media


@pytest.fixture(scope="module")
def servers(vlm_server: Server, fake_servers: SharedServers) -> dict:
    """vlm: conftest's tiny Qwen2.5-VL server (its media flags are this file's); text: conftest's
    shared text-only fake server (test_http_fake.py's "main"), which only refuses here."""
    return {"vlm": vlm_server.url, "text": fake_servers.get("main")["main"].url}


def _chat(url: str, content: list[dict], **extra: object) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NUM_NEW,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def _generate(url: str, text_before: str, text_after: str) -> dict:
    """/generate's text for the prompt the chat template must render (its tokens are checked
    against HF in test_vlm_server.py), with cat.png as a data: URL."""
    prompt = (
        f"<|im_start|>user\n{text_before}{IMAGE_PLACEHOLDER}{text_after}<|im_end|>\n<|im_start|>assistant\n"
    )
    body = {
        "text": prompt,
        "image_data": "data:image/png;base64," + base64.b64encode(_png(1)).decode(),
        "sampling_params": {"max_new_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True},
    }
    out = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert out.status_code == 200, out.text
    assert len(out.json()["output_ids"]) == NUM_NEW
    return out.json()


def test_image_url_forms_match_generate(servers: dict, media_url: str, local_dir: Path) -> None:
    url = servers["vlm"]
    want = _generate(url, "Hello ", " what is this?")
    data = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    forms = [data, f"{media_url}/cat.png", (local_dir / "cat.png").as_uri()]
    for form in forms:
        content = [
            {"type": "text", "text": "Hello "},
            _image(form),
            {"type": "text", "text": " what is this?"},
        ]
        out = _chat(url, content)
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["usage"]["completion_tokens"] == NUM_NEW
        # The same prompt, the image's tokens included, and the same greedy text.
        assert body["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        assert body["choices"][0]["message"]["content"] == want["text"], form[:40]


def test_responses_input_image(servers: dict) -> None:
    url = servers["vlm"]
    want = _generate(url, "Hello ", " what is this?")
    data = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    parts = [
        {"type": "input_text", "text": "Hello "},
        {"type": "input_image", "image_url": data, "detail": "auto"},
        {"type": "input_text", "text": " what is this?"},
    ]
    body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": 2, "store": False}
    out = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["input_tokens"] == want["meta_info"]["prompt_tokens"]


def _mm_cache(url: str) -> dict:
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    return info["internal_states"][0]["mm_cache"]


def test_embedding_cache_hit_is_counted(servers: dict) -> None:
    """The same new image after different text: the second request reads the cached embedding."""
    url = servers["vlm"]
    data = "data:image/png;base64," + base64.b64encode(_png(7)).decode()
    before = _mm_cache(url)
    assert before["capacity_bytes"] == 100 * 2**20  # --mm-cache-size-mb's default
    for text in ("First question about ", "A different opening, then "):
        out = _chat(url, [{"type": "text", "text": text}, _image(data)])
        assert out.status_code == 200, out.text
    after = _mm_cache(url)
    assert after["num_misses"] - before["num_misses"] == 1
    assert after["num_hits"] - before["num_hits"] == 1


@pytest.mark.parametrize(
    "image, message",
    [
        ("http://localhost:1/cat.png", "--allowed-media-domains"),
        ("{media}/missing.png", "answered 404"),
        ("{media}/big.png", "larger than 32 MiB"),
        ("{media}/slow.png", "longer than 1 s"),
        ("{media}/text.png", "Cannot decode an image"),
        ("file://{local}/../secret.png", "outside --allowed-local-media-path"),
        ("file://{local}/nothing.png", "Cannot read the image"),
        ("data:image/png;base64,!!!", "not valid base64"),
    ],
)
def test_bad_image_urls_are_400(
    servers: dict, media_url: str, local_dir: Path, image: str, message: str
) -> None:
    url = servers["vlm"]
    image = image.format(media=media_url, local=local_dir)
    err = assert_error(_chat(url, [_image(image), {"type": "text", "text": "what?"}]), 400)
    assert message in err["message"], err["message"]
    # /generate takes the same URLs through the same fetcher.
    body = {"text": f"a {IMAGE_PLACEHOLDER}", "image_data": image, "sampling_params": {"max_new_tokens": 1}}
    err = assert_error(httpx.post(f"{url}/generate", json=body, timeout=120), 400)
    assert message in err["message"], err["message"]
    assert _chat(url, [{"type": "text", "text": "hello"}]).status_code == 200


def test_image_url_refusals(servers: dict) -> None:
    data = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    err = assert_error(_chat(servers["text"], [{"type": "text", "text": "hi"}, _image(data)]), 400)
    assert "'messages[0].content[1].image_url' is not supported" in err["message"], err["message"]
    assert "text-only" in err["message"]
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [_image(data)]},
        ],
        "max_tokens": 1,
    }
    out = httpx.post(f"{servers['vlm']}/v1/chat/completions", json=body, timeout=60)
    assert "user messages only" in assert_error(out, 400)["message"]
