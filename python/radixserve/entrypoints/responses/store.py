"""The durable store of stored responses (store: true): SQLite, stdlib sqlite3.

With --storage-dir the database is `<dir>/responses.sqlite3` in WAL mode, else in memory
(sqlite_store.py); every call runs on the store's own thread (`ResponseStore`).

A row keeps the response object as last seen, the request's input items (with their ids), and,
for background responses, the event stream (for GET ?stream=true after the job ended). At open,
responses still queued or in progress were running when the server stopped: they are marked
failed (docs/http_api.md says why they are not resumed).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.sqlite_store import StoreThread, open_sqlite
from radixserve.entrypoints.sqlite_store import dumps as _dumps

DB_NAME = "responses.sqlite3"
INTERRUPTED = "The server stopped while this response was running; it was not resumed."
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    previous_response_id TEXT,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    events TEXT
)
"""


class SqliteResponses:
    """The synchronous store; use it from one thread only (ResponseStore does)."""

    def __init__(self, storage_dir: str | None) -> None:
        self.conn = open_sqlite(storage_dir, DB_NAME, _SCHEMA)
        self.fail_interrupted()

    def fail_interrupted(self) -> int:
        rows = self.conn.execute(
            "SELECT id, response FROM responses WHERE status IN ('queued', 'in_progress')"
        )
        failed = 0
        with self.conn:
            for rid, text in rows.fetchall():
                response = json.loads(text)
                response.update(status="failed", error={"code": "server_error", "message": INTERRUPTED})
                self._set(rid, response, None)
                failed += 1
        return failed

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT INTO responses (id, previous_response_id, status, response, input_items) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    response["id"],
                    response.get("previous_response_id"),
                    response["status"],
                    _dumps(response),
                    _dumps(input_items),
                ),
            )

    def update(self, response: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
        with self.conn:
            self._set(response["id"], response, events)

    def _set(self, rid: str, response: dict[str, Any], events: list[dict[str, Any]] | None) -> None:
        self.conn.execute(
            "UPDATE responses SET status = ?, response = ?, events = COALESCE(?, events) WHERE id = ?",
            (
                response["status"],
                _dumps(response),
                None if events is None else _dumps(events),
                rid,
            ),
        )

    def get(self, rid: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT response FROM responses WHERE id = ?", (rid,)).fetchone()
        return None if row is None else json.loads(row[0])

    def input_items(self, rid: str) -> list[dict[str, Any]] | None:
        row = self.conn.execute("SELECT input_items FROM responses WHERE id = ?", (rid,)).fetchone()
        return None if row is None else json.loads(row[0])

    def events(self, rid: str) -> list[dict[str, Any]] | None:
        row = self.conn.execute("SELECT events FROM responses WHERE id = ?", (rid,)).fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def delete(self, rid: str) -> bool:
        with self.conn:
            return self.conn.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def history(self, rid: str) -> list[dict[str, Any]] | None:
        """The conversation that `rid` ends, oldest first: each response's input items, then its
        output items. None when `rid` (or a response of its chain) is not stored."""
        turns: list[list[dict[str, Any]]] = []
        seen: set[str] = set()
        current: str | None = rid
        while current is not None:
            if current in seen:  # ids are random, so a cycle means a corrupt store
                raise ValueError(f"previous_response_id: the chain of {rid!r} loops.")
            seen.add(current)
            row = self.conn.execute(
                "SELECT response, input_items FROM responses WHERE id = ?", (current,)
            ).fetchone()
            if row is None:
                return None
            response = json.loads(row[0])
            turns.append([*json.loads(row[1]), *response.get("output", [])])
            current = response.get("previous_response_id")
        return [item for turn in reversed(turns) for item in turn]

    def close(self) -> None:
        self.conn.close()


class ResponseStore(StoreThread[SqliteResponses]):
    """The async face of the store: `await store.run(store.db.get, rid)`."""

    def __init__(self, storage_dir: str | None) -> None:
        super().__init__("response-store", lambda: SqliteResponses(storage_dir))
