"""Image URLs of a request fetched on the server's event loop, before tokenization.

`http(s)://` URLs are fetched with httpx's async client (never blocking the loop), only from the
hosts of `--allowed-media-domains` (vLLM's flag; here nothing is allowed unless listed), with a
byte cap and a timeout, and without following redirects (a redirect could leave the allow-list).
`file://` URLs are read only under `--allowed-local-media-path` (vLLM's flag), on a worker thread,
after resolving symlinks and `..`, so no path escapes the folder. Whatever fails is a 400 with the
reason (InvalidRequestError); nothing reaches the scheduler. The fetched bytes replace the URL in
the request's `image_data`; decoding stays on the tokenizer threads (processor.decode_image).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from radixserve.managers.generate_request import RequestItem
from radixserve.managers.input_validation import InvalidRequestError
from radixserve.multimodal.processor import MAX_IMAGE_BYTES

URL_SCHEMES = ("http://", "https://", "file://")


@dataclasses.dataclass(frozen=True)
class MediaFetcher:
    allowed_domains: frozenset[str]  # lower-case host names; empty: no http(s) URL is fetched
    allowed_local_path: str | None  # a real (symlink-free) folder; None: no file:// URL is read
    timeout_s: float
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def of(cls, server_args: Any) -> MediaFetcher:  # noqa: ANN401 - ServerArgs
        local = server_args.allowed_local_media_path
        return cls(
            frozenset(d.lower() for d in server_args.allowed_media_domains or ()),
            os.path.realpath(local) if local else None,
            float(server_args.media_fetch_timeout),
        )

    async def resolve(self, items: list[RequestItem]) -> list[RequestItem]:
        """`items` with every image URL replaced by the bytes it names (each URL fetched once
        per call: the samples of n > 1 share their prompt's images)."""
        urls = {u for item in items for u in item.image_data or () if _is_url(u)}
        if not urls:
            return items
        ordered = sorted(urls)
        fetched = dict(zip(ordered, await asyncio.gather(*(self.fetch(u) for u in ordered))))
        return [
            item
            if item.image_data is None
            else dataclasses.replace(item, image_data=tuple(fetched.get(x, x) for x in item.image_data))
            for item in items
        ]

    async def fetch(self, url: str) -> bytes:
        if url.startswith("file://"):
            return await asyncio.to_thread(self._read_local, url)
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.allowed_domains:
            raise InvalidRequestError(
                f"Image URLs from {host or 'this host'!r} are not fetched: the server fetches only from "
                "the domains listed in --allowed-media-domains (or send the image as a data: URL)."
            )
        try:
            return await asyncio.wait_for(self._get(url), self.timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            raise InvalidRequestError(
                f"Fetching the image {url} took longer than {self.timeout_s:g} s (--media-fetch-timeout)."
            ) from None
        except httpx.HTTPError as exc:
            raise InvalidRequestError(f"Cannot fetch the image {url}: {type(exc).__name__}: {exc}") from None

    async def _get(self, url: str) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(
                        f"Cannot fetch the image {url}: the server answered {response.status_code} "
                        "(redirects are not followed)."
                    )
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(url)
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise self._too_large(url)
                    chunks.append(chunk)
                return b"".join(chunks)

    def _too_large(self, url: str) -> InvalidRequestError:
        return InvalidRequestError(f"The image {url} is larger than {self.max_bytes // 2**20} MiB.")

    def _read_local(self, url: str) -> bytes:
        if self.allowed_local_path is None:
            raise InvalidRequestError(
                "Local image files are not read: start the server with --allowed-local-media-path "
                "to allow file:// URLs under one folder."
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"A file:// URL names a file on this host, not on {parts.netloc!r}.")
        path = os.path.realpath(unquote(parts.path))
        if os.path.commonpath([path, self.allowed_local_path]) != self.allowed_local_path:
            raise InvalidRequestError(f"{url} is outside --allowed-local-media-path.")
        try:
            if os.path.getsize(path) > self.max_bytes:
                raise InvalidRequestError(f"The image {url} is larger than {self.max_bytes // 2**20} MiB.")
            with open(path, "rb") as f:
                return f.read(self.max_bytes + 1)
        except OSError as exc:
            raise InvalidRequestError(f"Cannot read the image {url}: {exc.strerror}.") from None


def _is_url(image: str | bytes) -> bool:
    return isinstance(image, str) and image.startswith(URL_SCHEMES)
