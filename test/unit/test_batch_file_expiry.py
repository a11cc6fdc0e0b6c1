"""Files expire as OpenAI's do (entrypoints/batch/expiry.py): the upload's expires_after and its
bounds, 30 days by default for purpose "batch", a batch's output_expires_after on its output and
error files; past its expiry a file is gone for GET, content, list, delete and a new batch, and its
row is deleted. A store written before the expiry columns existed is upgraded in place."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any

import pytest

from radixserve.entrypoints.batch.expiry import MAX_EXPIRES_S, MIN_EXPIRES_S, form_expires_after
from radixserve.entrypoints.batch.multipart import FormField
from radixserve.entrypoints.batch.protocol import BatchCreateRequest
from radixserve.entrypoints.batch.runner import BatchRunner
from radixserve.entrypoints.batch.service import BatchService, NotFoundError
from radixserve.entrypoints.batch.store import DB_NAME, BatchStore
from radixserve.managers.input_validation import InvalidRequestError

T0 = 1_800_000_000
INPUT = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}\n'


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


class EchoLines:
    async def run(self, url: str, body: dict[str, Any]) -> Any:  # noqa: ANN401
        from radixserve.entrypoints.batch.lines import LineOutcome

        return LineOutcome(200, {"text": body["prompt"], "usage": {}})


def form(**fields: str) -> dict[str, FormField]:
    return {
        name.replace("__", "[").replace("_END", "]"): FormField(v.encode(), None)
        for name, v in fields.items()
    }


def service(store: BatchStore, clock: Clock) -> BatchService:
    runner = BatchRunner(store, EchoLines(), max_concurrent=2, clock=clock)  # type: ignore[arg-type]
    return BatchService(store, runner, is_generation=True, model="m")


def test_the_upload_form_gives_the_seconds_or_a_400() -> None:
    assert form_expires_after({}) is None
    assert (
        form_expires_after(form(expires_after__anchor_END="created_at", expires_after__seconds_END="7200"))
        == 7200
    )
    bad = [
        {"expires_after__anchor_END": "created_at"},  # no seconds
        {"expires_after__anchor_END": "last_active_at", "expires_after__seconds_END": "7200"},
        {"expires_after__anchor_END": "created_at", "expires_after__seconds_END": "soon"},
        {"expires_after__anchor_END": "created_at", "expires_after__seconds_END": str(MIN_EXPIRES_S - 1)},
        {"expires_after__anchor_END": "created_at", "expires_after__seconds_END": str(MAX_EXPIRES_S + 1)},
        {"expires_after": "3600"},  # not the client's form
    ]
    for fields in bad:
        with pytest.raises(InvalidRequestError, match="expires_after"):
            form_expires_after(form(**fields))


def test_files_expire_and_are_gone_everywhere() -> None:
    async def main() -> None:
        store, clock = BatchStore(None), Clock()
        svc = service(store, clock)
        short = await svc.upload("short.jsonl", "batch", INPUT, 3600)
        default = await svc.upload("long.jsonl", "batch", INPUT)
        assert short["expires_at"] == T0 + 3600
        assert default["expires_at"] == T0 + 30 * 24 * 3600  # OpenAI's default for purpose batch
        clock.now = T0 + 3599
        assert (await svc.file(short["id"]))["id"] == short["id"]  # not yet
        clock.now = T0 + 3600
        for call in (svc.file, svc.content, svc.delete_file):
            with pytest.raises(NotFoundError):
                await call(short["id"])
        assert [f.id for f in (await svc.files(None, None, 100, "desc")).data] == [default["id"]]
        with pytest.raises(NotFoundError):
            await svc.create(
                BatchCreateRequest(
                    input_file_id=short["id"], endpoint="/v1/completions", completion_window="24h"
                )
            )
        rows = store.db.conn.execute("SELECT id FROM files").fetchall()
        assert rows == [(default["id"],)]  # the expired file's bytes are deleted, not just hidden
        store.close()

    asyncio.run(main())


async def _ended(svc: BatchService, batch_id: str) -> dict[str, Any]:
    for _ in range(2000):
        batch = await svc.batch(batch_id)
        if batch["status"] == "completed":
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError("the batch did not complete")


@pytest.mark.parametrize("output_expiry", [None, 7200])
def test_output_files_follow_the_batchs_output_expires_after(output_expiry: int | None) -> None:
    async def main() -> None:
        store, clock = BatchStore(None), Clock()
        svc = service(store, clock)
        await svc.runner.start()
        file = await svc.upload("in.jsonl", "batch", INPUT)
        policy = None if output_expiry is None else {"anchor": "created_at", "seconds": output_expiry}
        req = BatchCreateRequest(
            input_file_id=file["id"],
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after=policy,
        )
        done = await _ended(svc, (await svc.create(req))["id"])
        out = await svc.file(done["output_file_id"])
        if output_expiry is None:
            assert out["expires_at"] is None  # kept until deleted, as OpenAI keeps batch_output files
        else:
            assert out["expires_at"] == out["created_at"] + output_expiry
            clock.now = out["created_at"] + output_expiry
            with pytest.raises(NotFoundError):
                await svc.content(done["output_file_id"])
        await svc.runner.close()
        store.close()

    asyncio.run(main())


def test_a_bad_output_expires_after_is_refused() -> None:
    from pydantic import ValidationError

    for policy in (
        {"anchor": "created_at", "seconds": 60},
        {"anchor": "now", "seconds": 3600},
        {"seconds": 3600},
    ):
        with pytest.raises(ValidationError):
            BatchCreateRequest(
                input_file_id="f",
                endpoint="/v1/completions",
                completion_window="24h",
                output_expires_after=policy,
            )


def test_a_store_from_before_expiry_is_upgraded(tmp_path) -> None:
    old = sqlite3.connect(tmp_path / DB_NAME)
    old.executescript(
        "CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, purpose TEXT NOT NULL,"
        " file TEXT NOT NULL, content BLOB NOT NULL);"
        "CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,"
        " batch TEXT NOT NULL);"
    )
    kept = {
        "id": "file-old",
        "object": "file",
        "bytes": 1,
        "created_at": T0,
        "filename": "x",
        "purpose": "batch",
    }
    old.execute(
        "INSERT INTO files (id, purpose, file, content) VALUES (?, ?, ?, ?)",
        ("file-old", "batch", json.dumps(kept), b"x"),
    )
    old.commit()
    old.close()

    async def main() -> None:
        store, clock = BatchStore(str(tmp_path)), Clock()
        clock.now = T0 + 10 * MAX_EXPIRES_S
        svc = service(store, clock)
        assert (await svc.file("file-old"))["id"] == "file-old"  # no expiry recorded: kept
        new = await svc.upload("n.jsonl", "batch", INPUT, 3600)
        assert new["expires_at"] == int(clock.now) + 3600
        store.close()

    asyncio.run(main())
