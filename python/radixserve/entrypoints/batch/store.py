"""The durable store of files and batches: SQLite (`<--storage-dir>/batches.sqlite3`, WAL; in
memory without the flag), run on its own thread (sqlite_store.py).

A batch copies its input lines into `batch_lines` when it is created (deleting the input file
later does not stop it). Each finished line is written with the batch object (its counts) in one
transaction, so after a crash the counts and the lines agree and the lines without a result are
exactly those to run again.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.batch.protocol import ACTIVE_STATUSES
from radixserve.entrypoints.sqlite_store import StoreThread, dumps, open_sqlite

DB_NAME = "batches.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    purpose TEXT NOT NULL,
    file TEXT NOT NULL,
    content BLOB NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    batch TEXT NOT NULL,
    output_expires_s INTEGER
);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    request TEXT NOT NULL,
    result TEXT,
    failed INTEGER,
    PRIMARY KEY (batch_id, line)
);
"""
# Columns added after the first release of the store: a database written before them gains them.
_ADDED_COLUMNS = (("files", "expires_at", "INTEGER"), ("batches", "output_expires_s", "INTEGER"))
Page = tuple[list[dict[str, Any]], bool]  # (objects, has_more)


class SqliteBatches:
    """The synchronous store; use it from one thread only (BatchStore does)."""

    def __init__(self, storage_dir: str | None) -> None:
        self.conn = open_sqlite(storage_dir, DB_NAME, _SCHEMA)
        with self.conn:
            for table, column, kind in _ADDED_COLUMNS:
                names = {row[1] for row in self.conn.execute(f"PRAGMA table_info({table})")}
                if column not in names:
                    self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            self.conn.execute("CREATE INDEX IF NOT EXISTS files_expiry ON files (expires_at)")

    # ------------------------------------------------------------------ files
    def put_file(self, file: dict[str, Any], content: bytes) -> None:
        with self.conn:
            self._insert_file(file, content)

    def _insert_file(self, file: dict[str, Any], content: bytes) -> None:
        self.conn.execute(
            "INSERT INTO files (id, purpose, file, content, expires_at) VALUES (?, ?, ?, ?, ?)",
            (file["id"], file["purpose"], dumps(file), content, file.get("expires_at")),
        )

    def purge_expired(self, now: int) -> int:
        """Delete the files whose expiry has come; how many went."""
        with self.conn:
            return self.conn.execute("DELETE FROM files WHERE expires_at <= ?", (now,)).rowcount

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT file FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def file_content(self, file_id: str) -> bytes | None:
        row = self.conn.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, file_id: str) -> bool:
        with self.conn:
            return self.conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def list_files(self, purpose: str | None, after: str | None, limit: int, desc: bool) -> Page:
        where, args = ("WHERE purpose = ?", [purpose]) if purpose is not None else ("", [])
        return self._page("files", "file", where, args, after, limit, desc)

    # ------------------------------------------------------------------ batches
    def put_batch(
        self, batch: dict[str, Any], requests: list[dict[str, Any]], output_expires_s: int | None = None
    ) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT INTO batches (id, status, batch, output_expires_s) VALUES (?, ?, ?, ?)",
                (batch["id"], batch["status"], dumps(batch), output_expires_s),
            )
            self.conn.executemany(
                "INSERT INTO batch_lines (batch_id, line, request) VALUES (?, ?, ?)",
                [(batch["id"], i, dumps(r)) for i, r in enumerate(requests)],
            )

    def update_batch(self, batch: dict[str, Any]) -> None:
        with self.conn:
            self._set_batch(batch)

    def _set_batch(self, batch: dict[str, Any]) -> None:
        self.conn.execute(
            "UPDATE batches SET status = ?, batch = ? WHERE id = ?",
            (batch["status"], dumps(batch), batch["id"]),
        )

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT batch FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def list_batches(self, after: str | None, limit: int) -> Page:
        return self._page("batches", "batch", "", [], after, limit, True)

    def active_batches(self) -> list[dict[str, Any]]:
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = self.conn.execute(
            f"SELECT batch FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE_STATUSES
        )
        return [json.loads(r[0]) for r in rows.fetchall()]

    def pending_lines(self, batch_id: str) -> list[tuple[int, dict[str, Any]]]:
        rows = self.conn.execute(
            "SELECT line, request FROM batch_lines WHERE batch_id = ? AND result IS NULL ORDER BY line",
            (batch_id,),
        )
        return [(line, json.loads(req)) for line, req in rows.fetchall()]

    def finish_line(self, batch: dict[str, Any], line: int, result: dict[str, Any], failed: bool) -> None:
        """The line's output and the batch (its counts) in one transaction."""
        with self.conn:
            self.conn.execute(
                "UPDATE batch_lines SET result = ?, failed = ? WHERE batch_id = ? AND line = ?",
                (dumps(result), int(failed), batch["id"], line),
            )
            self._set_batch(batch)

    def results(self, batch_id: str, failed: bool) -> list[str]:
        rows = self.conn.execute(
            "SELECT result FROM batch_lines WHERE batch_id = ? AND failed = ? ORDER BY line",
            (batch_id, int(failed)),
        )
        return [r[0] for r in rows.fetchall()]

    def finalize(self, batch: dict[str, Any], files: list[tuple[dict[str, Any], bytes]]) -> None:
        """The output and error files (expiring as the batch's output_expires_after says) and the
        batch's last state, together."""
        row = self.conn.execute(
            "SELECT output_expires_s FROM batches WHERE id = ?", (batch["id"],)
        ).fetchone()
        expires_s = row[0] if row is not None else None
        with self.conn:
            for file, content in files:
                if expires_s is not None:
                    file = {**file, "expires_at": file["created_at"] + expires_s}
                self._insert_file(file, content)
            self._set_batch(batch)
            # The results now live in the files; the lines are not needed any more.
            self.conn.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch["id"],))

    # ------------------------------------------------------------------ lists
    def _page(
        self, table: str, column: str, where: str, args: list[Any], after: str | None, limit: int, desc: bool
    ) -> Page:
        """A cursor page, OpenAI's way: `after` is the id of the last object seen."""
        order = "DESC" if desc else "ASC"
        if after is not None:
            row = self.conn.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise ValueError(f"after: no object {after!r} in this list.")
            cond = f"seq {'<' if desc else '>'} ?"
            where = f"{where} AND {cond}" if where else f"WHERE {cond}"
            args = [*args, row[0]]
        rows = self.conn.execute(
            f"SELECT {column} FROM {table} {where} ORDER BY seq {order} LIMIT ?", (*args, limit + 1)
        ).fetchall()
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def close(self) -> None:
        self.conn.close()


class BatchStore(StoreThread[SqliteBatches]):
    """The async face of the store: `await store.run(store.db.get_file, file_id)`."""

    def __init__(self, storage_dir: str | None) -> None:
        super().__init__("batch-store", lambda: SqliteBatches(storage_dir))
