"""The SQLite store's versioned schema: shipped SQL migrations, tracked in a metadata table.

Opening a file never guesses. It is inspected read-only first, and anything that is not an empty
database or a tritask store of a version this code knows is refused with :class:`StoreSchemaError`
before a single byte is written: no reset, no "repair", no WAL switch on a stranger's file.

* ``PRAGMA application_id`` marks the file as tritask's (``TRIT``);
* ``tritask_metadata`` holds the schema version, the store's UUID and the boot epoch;
* ``migrations/NNNN_name.sql`` are applied in order inside one ``BEGIN IMMEDIATE`` transaction,
  so concurrent openers of a fresh file cannot both install it.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import uuid
from importlib import resources

import attrs

from tritask.tasks.store import StoreError

__all__ = [
    "APPLICATION_ID",
    "SCHEMA_VERSION",
    "Migration",
    "SchemaInfo",
    "StoreSchemaError",
    "inspect",
    "install",
    "migrations",
    "rollback",
]

APPLICATION_ID = 0x54524954
"""``PRAGMA application_id`` of a tritask store: the bytes ``TRIT``."""

TABLES = frozenset(
    {"tritask_metadata", "tritask_tasks", "tritask_task_events", "tritask_owner_leases"}
)

_MIGRATION_NAME = re.compile(r"([0-9]{4})_[a-z0-9_]+\.sql")


class StoreSchemaError(StoreError):
    """The file is not a tritask SQLite store this code can open; it was left untouched."""


@attrs.frozen
class Migration:
    version: int
    name: str
    sql: str

    def statements(self) -> list[str]:
        """Split on complete statements (``executescript`` would commit our transaction)."""
        statements: list[str] = []
        pending = ""
        for line in self.sql.splitlines(keepends=True):
            pending += line
            if sqlite3.complete_statement(pending):
                statements.append(pending.strip())
                pending = ""
        leftover = [line for line in pending.splitlines() if line.strip()]
        if any(not line.lstrip().startswith("--") for line in leftover):
            raise StoreSchemaError(f"migration {self.name} ends with an incomplete statement")
        return statements


@functools.cache
def migrations() -> tuple[Migration, ...]:
    """The shipped migrations, checked to be numbered 1..N without gaps."""
    found: list[Migration] = []
    for entry in resources.files(__package__ or "tritask_sqlite").joinpath("migrations").iterdir():
        match = _MIGRATION_NAME.fullmatch(entry.name)
        if match is not None:
            found.append(Migration(int(match[1]), entry.name, entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise StoreSchemaError("the packaged migrations are not numbered 1..N")
    return tuple(found)


SCHEMA_VERSION = len(migrations())
"""The schema version this code writes and the newest it can open."""


@attrs.frozen
class SchemaInfo:
    """What an opened store read from (or wrote to) its metadata row."""

    version: int
    store_id: str
    boot_epoch: int


def rollback(conn: sqlite3.Connection) -> None:
    """End the open transaction, if any (SQLite may already have rolled it back itself)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _refuse(path: str, problem: str) -> StoreSchemaError:
    return StoreSchemaError(f"refusing to open {path!r}: {problem}; the file was not modified")


def _user_tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ).fetchall()
    return {str(row[0]) for row in rows}


def _metadata(conn: sqlite3.Connection, path: str) -> SchemaInfo:
    try:
        rows = conn.execute(
            "SELECT singleton, schema_version, store_id, boot_epoch FROM tritask_metadata"
        ).fetchall()
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"its tritask_metadata table is unreadable ({exc})") from exc
    if len(rows) != 1:
        raise _refuse(path, f"tritask_metadata holds {len(rows)} rows instead of 1")
    singleton, version, store_id, epoch = rows[0]
    if (
        singleton != 1
        or type(version) is not int
        or version <= 0
        or type(store_id) is not str
        or type(epoch) is not int
        or epoch < 0
    ):
        raise _refuse(path, "its tritask_metadata row is corrupt")
    try:
        uuid.UUID(store_id)
    except ValueError:
        raise _refuse(path, "its store id is not a UUID") from None
    if version > SCHEMA_VERSION:
        raise _refuse(
            path,
            f"its schema version {version} is newer than this tritask_sqlite supports "
            f"({SCHEMA_VERSION}); upgrade tritask to open it",
        )
    return SchemaInfo(version, store_id, epoch)


def inspect(conn: sqlite3.Connection, path: str) -> SchemaInfo | None:
    """Classify the file read-only: ``None`` for an empty database, else its metadata.

    Raises :class:`StoreSchemaError` for a non-SQLite file, another application's database,
    a damaged tritask store or a newer schema version. The reads share one transaction, so a
    concurrent installer's commit is seen entirely or not at all.
    """
    if conn.in_transaction:
        return _inspect(conn, path)
    conn.execute("BEGIN")
    try:
        return _inspect(conn, path)
    finally:
        rollback(conn)


def _inspect(conn: sqlite3.Connection, path: str) -> SchemaInfo | None:
    try:
        application_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = _user_tables(conn)
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"it is not an SQLite database or is damaged ({exc})") from exc
    if application_id == 0 and not tables:
        return None
    if application_id != APPLICATION_ID:
        listed = ", ".join(sorted(tables)[:5]) or "none"
        raise _refuse(
            path,
            f"it is an SQLite database of another application "
            f"(application_id {application_id:#x}, tables: {listed})",
        )
    missing = TABLES - tables
    if "tritask_metadata" in missing:
        raise _refuse(path, "it is marked as a tritask store but has no tritask_metadata table")
    info = _metadata(conn, path)
    if info.version == SCHEMA_VERSION and missing:
        raise _refuse(path, f"it lacks the tables {sorted(missing)}")
    return info


def install(conn: sqlite3.Connection, path: str, *, advance_epoch: bool) -> SchemaInfo:
    """Bring the schema to :data:`SCHEMA_VERSION` and optionally advance the boot epoch.

    One ``BEGIN IMMEDIATE`` transaction: it re-inspects under the write lock (another process may
    have installed the schema meanwhile), applies the missing migrations, and commits.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        info = inspect(conn, path)
        if info is None:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            current = 0
        else:
            current = info.version
        for migration in migrations()[current:]:
            try:
                for statement in migration.statements():
                    conn.execute(statement)
            except sqlite3.DatabaseError as exc:
                # A row the new schema's CHECKs refuse (0005 rebuilds the tables), a full disk:
                # the whole transaction is rolled back below, so the file is as it was.
                raise _refuse(path, f"migration {migration.name} failed ({exc})") from exc
            if migration.version == 1:
                conn.execute(
                    "INSERT INTO tritask_metadata (singleton, schema_version, store_id) "
                    "VALUES (1, 1, ?)",
                    (str(uuid.uuid4()),),
                )
            else:
                conn.execute("UPDATE tritask_metadata SET schema_version = ?", (migration.version,))
        if advance_epoch:
            conn.execute("UPDATE tritask_metadata SET boot_epoch = boot_epoch + 1")
        info = inspect(conn, path)
        assert info is not None and info.version == SCHEMA_VERSION
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return info
