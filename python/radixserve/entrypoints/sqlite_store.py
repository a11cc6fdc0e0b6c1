"""What the durable stores share (responses/store.py, batch/store.py): how a SQLite database is
opened, and the one thread that runs every call on it.

With --storage-dir the database is a file there in WAL mode (readers never wait for the writer,
and a crash loses at most the last transaction); without it the database lives in memory and ends
with the server. A connection is only ever used by its store's own thread, so a disk write never
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
D = TypeVar("D")  # the synchronous store: SqliteResponses, SqliteBatches


def open_sqlite(storage_dir: str | None, db_name: str, schema: str) -> sqlite3.Connection:
    """`<storage_dir>/<db_name>` (WAL), or an in-memory database; `schema` is run once."""
    if storage_dir is None:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
    else:
        os.makedirs(storage_dir, exist_ok=True)
        conn = sqlite3.connect(os.path.join(storage_dir, db_name), check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint, as WAL intends
    with conn:
        conn.executescript(schema)
    return conn


def dumps(value: object) -> str:
    # The stdlib encoder, not orjson: a request may carry integers past 64 bits (in a schema) and
    # lone surrogates (escaped here as \\udXXX), which orjson refuses.
    return json.dumps(value)


class StoreThread(Generic[D]):
    """A store's async face: one worker thread that owns the synchronous store `db`, built there,
    called there (`await store.run(store.db.get, key)`), closed there."""

    def __init__(self, name: str, build: Callable[[], D]) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.db: D = self._executor.submit(build).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        """One call of the store's (`fn`, a method of `db`), on its thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.submit(self.db.close).result()
        self._executor.shutdown(wait=True)
