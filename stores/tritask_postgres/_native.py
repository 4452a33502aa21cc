"""Statements on a psycopg connection, driven from the trio thread through libpq's own
non-blocking API (``psycopg.pq``), with no worker thread.

Why: through ``trio.to_thread`` every statement costs a thread hop, and each blocking libpq call
hands the GIL to another thread and waits to get it back: a bare loop of two single-statement
commits per task took 0.45 ms of CPU per task that way, 0.11 ms without threads. psycopg's
``AsyncConnection`` is asyncio-only, but libpq's non-blocking calls (send, flush, consume input,
get result) need nothing but a readable or writable socket, which trio waits for like any other
socket.

The connection is still a psycopg ``Connection``: psycopg connects it (parsing the conninfo,
TLS, multiple hosts) and it stays usable by psycopg code in a worker thread between calls
(migrations, the schema check). A :class:`Session` adds:

* :class:`Statement`: SQL with psycopg's ``%(name)s`` placeholders, turned into ``$n`` once.
  Each connection prepares it on first use, as a named statement.
* Parameters sent as text: ``str``, ``int``, ``bool``, ``None``; lists of ``str``, ``int`` and
  ``None`` go as a binary ``text[]`` (cast the placeholder to ``text[]``). Every placeholder's
  type comes from an explicit cast or from its context in the SQL. Text containing NUL is
  refused, as psycopg refuses it: libpq would cut it there.
* Result columns loaded by type: integers, booleans and text-like types (``text``, ``json``,
  ``uuid``, ...). Any other type is a programming error and raises ``TypeError``.
* Errors raised as psycopg raises them (the same classes, with ``diag``), so callers catch
  ``psycopg.errors.LockNotAvailable`` and friends as before.
* Round trips saved with libpq's pipeline mode: :meth:`Session.pipeline` sends several
  statements at once (each still its own statement, with its own snapshot), a transaction's
  ``BEGIN`` goes with its first statement, and ``execute(..., commit=True)`` carries the
  ``COMMIT``. A settle is two round trips: ``BEGIN`` + lock + clock and ledger read, then
  write + ``COMMIT``.
* Cancellation that really stops the query: a cancelled wait sends a server-side cancel
  request (``cancel_safe``, in a worker thread), then waits, shielded, for the statement's
  answer. A statement cancelled by us raises trio's ``Cancelled``. A statement that finished
  first returns its result as an uncancelled call would, and the caller's next checkpoint
  raises. The connection is never left busy: if the server does not answer in time, it is
  closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import struct
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs
import psycopg
import trio
from psycopg import pq

__all__ = ["COMMIT", "Result", "Session", "Statement", "statement"]

log = logging.getLogger("tritask_postgres")

CANCEL_TIMEOUT_S: Final = 5.0
_QUERY_CANCELED: Final = b"57014"
_PLACEHOLDER: Final = re.compile(rb"%\((\w+)\)s|%%|%")
_NUL_MESSAGE: Final = "PostgreSQL text fields cannot contain NUL (0x00) bytes"


@attrs.frozen
class Statement:
    """SQL ready to send: ``$n`` placeholders, the parameter name of each, a prepared name."""

    text: bytes
    names: tuple[str, ...]
    name: bytes


def statement(sql: bytes | str) -> Statement:
    """Turn psycopg-style SQL (``%(name)s``, ``%%``) into a :class:`Statement`."""
    source = sql.encode("utf-8") if isinstance(sql, str) else sql
    names: list[str] = []

    def placeholder(match: re.Match[bytes]) -> bytes:
        token = match.group(0)
        if token == b"%%":
            return b"%"
        if token == b"%":
            raise ValueError(f"a lone % in SQL: {source[:80]!r}")
        name = match.group(1).decode("ascii")
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    text = _PLACEHOLDER.sub(placeholder, source)
    digest = hashlib.blake2b(text, digest_size=12).hexdigest()
    return Statement(text=text, names=tuple(names), name=f"tritask_{digest}".encode("ascii"))


def _dump(value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        if "\x00" in value:
            raise psycopg.DataError(_NUL_MESSAGE)
        return value.encode("utf-8")
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return int.__repr__(value).encode("ascii")
    raise TypeError(f"cannot send a {type(value).__name__} as a parameter")


_TEXT_OID: Final = 25
_ARRAY_HEAD: Final = struct.Struct("!iiIii")
_EMPTY_ARRAY: Final = struct.pack("!iiI", 0, 0, _TEXT_OID)
_NULL_ELEMENT: Final = b"\xff\xff\xff\xff"
_length = struct.Struct("!i").pack


def _text_array(values: Sequence[object]) -> bytes:
    """A ``text[]`` in PostgreSQL's binary array format (``array_send``'s): no quoting to
    escape here and no literal to parse on the server, whose cost grew with the JSON documents
    a batch sends. Every string as its UTF-8 bytes; ``None`` is a NULL element and an ``int``
    its digits (cast on the server, e.g. ``::text[]::bigint[]``), so a batch's rows go as one
    array per column."""
    if not values:
        return _EMPTY_ARRAY
    parts = []
    nulls = 0
    for value in values:
        if isinstance(value, str):
            if "\x00" in value:
                raise psycopg.DataError(_NUL_MESSAGE)
            data = value.encode("utf-8")
        elif value is None:
            nulls = 1
            parts.append(_NULL_ELEMENT)
            continue
        elif isinstance(value, int) and not isinstance(value, bool):
            data = int.__repr__(value).encode("ascii")
        else:
            raise TypeError("array parameters hold strings, ints and None only")
        parts.append(_length(len(data)))
        parts.append(data)
    return _ARRAY_HEAD.pack(1, nulls, _TEXT_OID, len(values), 1) + b"".join(parts)


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _bool(data: bytes) -> bool:
    return data == b"t"


def _void(data: bytes) -> None:
    return None


_LOADERS: Final[Mapping[int, Callable[[bytes], object]]] = {
    16: _bool,  # bool
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    26: int,  # oid
    18: _text,  # "char"
    19: _text,  # name
    25: _text,  # text
    114: _text,  # json
    705: _text,  # unknown (an untyped literal)
    1042: _text,  # bpchar
    1043: _text,  # varchar
    2950: _text,  # uuid
    3802: _text,  # jsonb
    2278: _void,  # void (pg_notify)
}


@attrs.frozen
class Result:
    """A statement's rows (loaded) and the number of rows it affected or returned."""

    rows: list[tuple[Any, ...]]
    rowcount: int

    def fetchone(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows


def _load(result: pq.abc.PGresult) -> Result:
    width = result.nfields
    loaders = []
    for column in range(width):
        oid = result.ftype(column)
        loader = _LOADERS.get(oid)
        if loader is None:
            raise TypeError(f"no loader for PostgreSQL type oid {oid}: cast the column")
        loaders.append(loader)
    rows = []
    get = result.get_value
    for row in range(result.ntuples):
        values = []
        for column in range(width):
            data = get(row, column)
            values.append(None if data is None else loaders[column](data))
        rows.append(tuple(values))
    tuples = result.command_tuples
    return Result(rows=rows, rowcount=-1 if tuples is None else tuples)


_BEGIN: Final = statement(b"BEGIN")
_COMMIT: Final = statement(b"COMMIT")
#: ``COMMIT``, for a pipeline that ends its transaction with its last statement.
COMMIT: Final = _COMMIT
_ROLLBACK: Final = statement(b"ROLLBACK")


class Session:
    """One pooled connection's statements, run from the trio thread (one caller at a time)."""

    __slots__ = ("_begin", "_cancellers", "_prepared", "conn", "pgconn")

    def __init__(self, conn: psycopg.Connection[Any], cancellers: trio.CapacityLimiter) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self._prepared: set[bytes] = set()
        self._cancellers = cancellers
        self._begin = False  # a transaction was opened; BEGIN goes with its first statement

    @property
    def idle(self) -> bool:
        """Connected, outside any transaction, nothing pending: reusable by the next caller."""
        pgconn = self.pgconn
        return (
            not self._begin
            and pgconn.status == pq.ConnStatus.OK
            and pgconn.transaction_status == pq.TransactionStatus.IDLE
            and pgconn.pipeline_status == pq.PipelineStatus.OFF
        )

    async def execute(
        self, stmt: Statement, params: Mapping[str, object] | None = None, *, commit: bool = False
    ) -> Result:
        """Run one statement; raise psycopg's error for a failed one. ``commit``: end the
        transaction with a ``COMMIT`` sent with the statement (one round trip for both)."""
        if commit:
            result, _ = await self.pipeline((stmt, params), (_COMMIT, None))
            return result
        if self._begin:
            (result,) = await self.pipeline((stmt, params))
            return result
        await trio.lowlevel.checkpoint_if_cancelled()
        values, formats = _values(stmt, params)
        await self._prepare((stmt,))
        self.pgconn.send_query_prepared(stmt.name, values, formats)
        results = await self._results(pipelined=False)
        self._raise_failure(results, 1)
        return _load(results[0])

    async def pipeline(self, *calls: tuple[Statement, Mapping[str, object] | None]) -> list[Result]:
        """Several statements in one round trip (libpq's pipeline mode), each still its own
        statement (a READ COMMITTED snapshot of its own). A failure raises; the statements after
        it were skipped by the server. A ``BEGIN`` opened by :meth:`transaction` goes first."""
        await trio.lowlevel.checkpoint_if_cancelled()
        sends = [(stmt, _values(stmt, params)) for stmt, params in calls]
        begin = self._begin
        if begin:
            sends.insert(0, (_BEGIN, (None, None)))
        await self._prepare([stmt for stmt, _ in sends])
        pgconn = self.pgconn
        pgconn.enter_pipeline_mode()
        try:
            for stmt, (values, formats) in sends:
                pgconn.send_query_prepared(stmt.name, values, formats)
            pgconn.pipeline_sync()
            self._begin = False
            results = await self._results(pipelined=True)
        finally:
            if (
                pgconn.status == pq.ConnStatus.OK
                and pgconn.pipeline_status != pq.PipelineStatus.OFF
            ):
                # Every result has been read (also after a cancel): leaving cannot fail then,
                # and a connection still in pipeline mode is never reused (see ``idle``).
                with contextlib.suppress(psycopg.Error):
                    pgconn.exit_pipeline_mode()
        self._raise_failure(results, len(sends))
        return [_load(result) for result in results[1 if begin else 0 :]]

    async def _prepare(self, stmts: Sequence[Statement]) -> None:
        """Prepare on this connection, once, the statements it has not seen yet."""
        for stmt in stmts:
            if stmt.name not in self._prepared:
                self.pgconn.send_prepare(stmt.name, stmt.text)
                self._raise_failure(await self._results(pipelined=False), 1)
                self._prepared.add(stmt.name)

    @staticmethod
    def _raise_failure(results: list[pq.abc.PGresult], expected: int) -> None:
        for result in results:
            if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
                raise psycopg.errors.error_from_result(result, encoding="utf-8")
        if len(results) != expected:
            raise psycopg.OperationalError(
                f"the server sent {len(results)} results for {expected} statements"
            )

    async def _results(self, *, pipelined: bool) -> list[pq.abc.PGresult]:
        """Send what is queued and collect the answer; on cancellation see the module doc."""
        try:
            return await self._collect(pipelined)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                late = await self._cancel_and_collect(pipelined)
            if late is None or any(
                r.error_field(pq.DiagnosticField.SQLSTATE) == _QUERY_CANCELED for r in late
            ):
                raise  # our cancel stopped it (or the connection had to be closed)
            return late

    async def _collect(self, pipelined: bool) -> list[pq.abc.PGresult]:
        """The results of what was sent: up to the end of one statement's results, or (in
        pipeline mode) up to the pipeline's sync point. Aborted (skipped) results are kept."""
        pgconn = self.pgconn
        fd = pgconn.socket
        while pgconn.flush():
            # Drain what the server sends meanwhile (notices), so neither side can block.
            pgconn.consume_input()
            await trio.lowlevel.wait_writable(fd)
        results: list[pq.abc.PGresult] = []
        while True:
            if pgconn.is_busy():
                await trio.lowlevel.wait_readable(fd)
                pgconn.consume_input()  # raises OperationalError when the connection is lost
                continue
            result = pgconn.get_result()
            if result is None:
                if pipelined:
                    continue  # the end of one statement's results; more follow
                return results
            if pipelined and result.status == pq.ExecStatus.PIPELINE_SYNC:
                return results
            results.append(result)

    async def _cancel_and_collect(self, pipelined: bool) -> list[pq.abc.PGresult] | None:
        """Shielded: ask the server to cancel, then wait for the statement's answer. ``None``
        when the connection had to be closed instead."""
        with trio.move_on_after(CANCEL_TIMEOUT_S * 2):
            try:
                await trio.to_thread.run_sync(self._cancel_quietly, limiter=self._cancellers)
                return await self._collect(pipelined)
            except psycopg.Error as exc:
                log.warning("a cancelled PostgreSQL statement left its connection: %s", exc)
        self.conn.close()
        return None

    def _cancel_quietly(self) -> None:
        try:
            self.conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)
        except Exception as exc:  # the statement still ends: at the latest at its timeout
            log.warning("could not cancel a PostgreSQL query: %s", exc)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """A transaction: ``BEGIN`` goes with the body's first statement, ``COMMIT`` after the
        body (unless its last statement committed: ``execute(..., commit=True)``), and a
        shielded ``ROLLBACK`` when the body raises."""
        if self._begin or self.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            raise RuntimeError("a transaction is already open on this connection")
        self._begin = True
        try:
            yield
        except BaseException:
            self._begin = False
            with trio.CancelScope(shield=True):
                await self._rollback_quietly()
            raise
        if self._begin:  # the body sent nothing
            self._begin = False
        elif self.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            await self.execute(_COMMIT)

    async def _rollback_quietly(self) -> None:
        if self.pgconn.status != pq.ConnStatus.OK:
            return
        if self.pgconn.transaction_status == pq.TransactionStatus.IDLE:
            return
        with trio.move_on_after(CANCEL_TIMEOUT_S):
            try:
                await self.execute(_ROLLBACK)
                return
            except psycopg.Error as exc:
                log.warning("could not roll back a PostgreSQL transaction: %s", exc)
        self.conn.close()  # not idle, not rolled back: never reuse it


_Values = tuple[list[bytes | None] | None, list[int] | None]


def _values(stmt: Statement, params: Mapping[str, object] | None) -> _Values:
    """The parameters as libpq sends them, and their formats when one is binary (a list, as a
    binary ``text[]``; every other parameter is text)."""
    if not stmt.names:
        return None, None
    if params is None:
        raise KeyError(stmt.names[0])
    values: list[bytes | None] = []
    formats: list[int] | None = None
    for index, name in enumerate(stmt.names):
        value = params[name]
        if isinstance(value, (list, tuple)):
            if formats is None:
                formats = [0] * len(stmt.names)
            formats[index] = 1
            values.append(_text_array(value))
        else:
            values.append(_dump(value))
    return values, formats
