"""Versioned schema migrations, owned by the application and run explicitly.

The SQL files in ``migrations/`` (``0001_initial.sql``, ...) are applied in order, each recorded
in ``<schema>.schema_migrations`` with its checksum. Everything runs in one transaction under a
transaction-scoped advisory lock keyed on the schema name, so concurrent ``migrate`` calls (every
host of a rolling deploy) serialize: the first applies, the others find nothing to do. An applied
migration whose file changed is refused: migrations are immutable once shipped.

The store never migrates on its own; it checks the version when it opens and refuses a mismatch
(:class:`StoreSchemaError`), so a deploy cannot silently run against a schema it does not know.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from importlib import resources
from typing import Any, Final

import attrs
import psycopg
import trio
from psycopg import sql

from tritask.tasks.store import StoreError

__all__ = [
    "DEFAULT_SCHEMA",
    "SCHEMA_VERSION",
    "Migration",
    "MigrationResult",
    "StoreSchemaError",
    "check_schema",
    "latest_version",
    "load_migrations",
    "migrate",
    "migrate_connection",
    "redact_dsn",
    "resolve_schema",
    "split_store_url",
    "validate_schema_name",
]

DEFAULT_SCHEMA: Final = "tritask"
MIGRATE_LOCK_CLASS: Final = 0x74726D67
"""First key of the migration advisory lock ('trmg'); the second is ``hashtext(schema)``."""

_FILE_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
_SCHEMA_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,54}")


class StoreSchemaError(StoreError):
    """The database schema is missing, older or newer than this tritask expects."""


def validate_schema_name(schema: object) -> str:
    """A plain identifier of at most 55 characters (the NOTIFY channel adds a suffix)."""
    if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
        raise ValueError(
            f"schema must be an identifier of letters, digits and '_' (at most 55), not {schema!r}"
        )
    return schema


@attrs.frozen
class Migration:
    version: int
    name: str
    sql: str = attrs.field(repr=False)

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


@attrs.frozen
class MigrationResult:
    """What :func:`migrate` did: the versions it applied now (empty when up to date)."""

    schema: str
    version: int
    applied: tuple[int, ...]


def load_migrations() -> tuple[Migration, ...]:
    """The shipped migrations in version order; versions must run 1, 2, 3... without gaps."""
    found: list[Migration] = []
    for entry in resources.files("tritask_postgres").joinpath("migrations").iterdir():
        match = _FILE_RE.fullmatch(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError("tritask_postgres migrations must be numbered 0001, 0002, ... in order")
    return tuple(found)


def latest_version() -> int:
    return len(load_migrations())


SCHEMA_VERSION: Final = latest_version()
"""The schema version this code needs (the number of shipped migrations)."""


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, for messages."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        return "postgresql://..."
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}@{hostinfo}" if user else hostinfo
    query = urllib.parse.urlencode(
        [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "password"]
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def split_store_url(url: str) -> tuple[str, str | None]:
    """Split ``?schema=NAME`` off a ``postgresql://`` URL (libpq would refuse the parameter)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.query:
        return url, None
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in pairs if k == "schema"]
    if not schemas:
        return url, None
    if len(schemas) > 1:
        raise ValueError("the store URL names ?schema= more than once")
    query = urllib.parse.urlencode([(k, v) for k, v in pairs if k != "schema"])
    return urllib.parse.urlunsplit(parts._replace(query=query)), schemas[0]


def resolve_schema(dsn: str, schema: str | None) -> tuple[str, str]:
    """The libpq conninfo and the validated schema from a URL and/or an explicit option."""
    conninfo, url_schema = split_store_url(dsn)
    if schema is not None and url_schema is not None and schema != url_schema:
        raise ValueError(f"schema={schema!r} contradicts the URL's ?schema={url_schema}")
    chosen = schema if schema is not None else url_schema
    return conninfo, validate_schema_name(DEFAULT_SCHEMA if chosen is None else chosen)


def _migrate_hint(dsn: str, schema: str) -> str:
    flag = "" if schema == DEFAULT_SCHEMA else f" --schema {schema}"
    return f"run `tritask migrate --store {redact_dsn(dsn)}{flag}`"


def _applied(conn: psycopg.Connection[Any], schema: str) -> dict[int, str] | None:
    """``version -> checksum`` of the applied migrations, ``None`` when never migrated."""
    exists = conn.execute(
        "SELECT to_regclass(format('%%I.schema_migrations', %s::text)) IS NOT NULL", (schema,)
    ).fetchone()
    if exists is None or not exists[0]:
        return None
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {int(version): str(checksum) for version, checksum in rows}


def migrate_connection(conn: psycopg.Connection[Any], schema: str) -> MigrationResult:
    """Apply the pending migrations on ``conn`` (blocking; autocommit connection)."""
    schema = validate_schema_name(schema)
    migrations = load_migrations()
    ident = sql.Identifier(schema)
    with conn.transaction():
        # READ COMMITTED whatever the database's or role's default_transaction_isolation: a
        # migration that reads the rows after locking a table (0004 seeds task_counts after
        # LOCK TABLE tasks) must see what the writers it waited for committed, not the
        # snapshot of the transaction's first statement.
        conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (MIGRATE_LOCK_CLASS, schema))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY CHECK (version > 0),"
                " name text NOT NULL,"
                " checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(ident)
        )
        applied = _applied(conn, schema) or {}
        known = {m.version: m for m in migrations}
        newer = sorted(v for v in applied if v not in known)
        if newer:
            raise StoreSchemaError(
                f"PostgreSQL schema {schema!r} has migration {newer[-1]}, newer than this "
                f"tritask knows ({len(migrations)}): upgrade tritask"
            )
        for version, checksum in sorted(applied.items()):
            if known[version].checksum != checksum:
                raise StoreSchemaError(
                    f"migration {version:04d}_{known[version].name} applied to schema "
                    f"{schema!r} differs from the shipped file; migrations are immutable"
                )
        done: list[int] = []
        for migration in migrations:
            if migration.version in applied:
                continue
            conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(ident))
            conn.execute(migration.sql.encode())
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
                ).format(ident),
                (migration.version, migration.name, migration.checksum),
            )
            done.append(migration.version)
        conn.execute("SET LOCAL search_path TO DEFAULT")
    return MigrationResult(schema=schema, version=len(migrations), applied=tuple(done))


def check_schema(conn: psycopg.Connection[Any], dsn: str, schema: str) -> str:
    """Refuse a missing or mismatched schema; return the store id (blocking)."""
    expected = load_migrations()
    applied = _applied(conn, schema)
    if not applied:
        raise StoreSchemaError(
            f"PostgreSQL schema {schema!r} is not installed: {_migrate_hint(dsn, schema)}"
        )
    version = max(applied)
    if version > len(expected):
        raise StoreSchemaError(
            f"PostgreSQL schema {schema!r} is at version {version}, newer than this tritask "
            f"supports ({len(expected)}): upgrade tritask"
        )
    if sorted(applied) != list(range(1, len(expected) + 1)):
        raise StoreSchemaError(
            f"PostgreSQL schema {schema!r} is at version {version}, this tritask needs "
            f"{len(expected)}: {_migrate_hint(dsn, schema)}"
        )
    row = conn.execute(
        sql.SQL("SELECT store_id::text FROM {}.store_metadata").format(sql.Identifier(schema))
    ).fetchone()
    if row is None:
        raise StoreSchemaError(f"PostgreSQL schema {schema!r} has no store metadata row")
    return str(row[0])


async def migrate(dsn: str, *, schema: str | None = None) -> MigrationResult:
    """Bring ``schema`` (default ``tritask``) to the latest version.

    Idempotent and safe to run concurrently. ``dsn`` is a libpq URL or conninfo string; a
    ``postgresql://`` store URL may name the schema as ``?schema=NAME`` instead. The call runs
    in one worker thread and is not interrupted by trio cancellation (it is one transaction).
    """
    conninfo, target = resolve_schema(dsn, schema)

    def run() -> MigrationResult:
        with psycopg.Connection.connect(
            conninfo, autocommit=True, application_name="tritask-migrate"
        ) as conn:
            return migrate_connection(conn, target)

    return await trio.to_thread.run_sync(run)
