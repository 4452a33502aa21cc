"""The read-only operator commands read a SQLite file while ``tritask serve`` holds it.

``tritask serve`` opens its SQLite store exclusively (a file lock, and a boot epoch advanced on
every open, which fences the claims of a crashed predecessor). ``tritask tasks list|show|stats``
open the file read-only: no lock, no migration, no epoch, nothing written, so they work beside
the running server and leave its claims alone; the server goes on finishing its tasks
afterwards. The commands that write (``cancel``, ``reap``) still need the file and say so in
one line.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from tritask_sqlite import ReadOnlyStore, SqliteStore, schema

from tritask.tasks.model import new_task
from tritask.tasks.store import NOT_FOUND, Action
from tritask.tasks.work import Work
from tritask.testing import ServeProcess
from tritask.testing.client import Client, HttpTransport

APP = f"{Path(__file__).parent / 'ops_app.py'}:app"


@asynccontextmanager
async def running_server(db: Path) -> AsyncIterator[Client]:
    """A real ``tritask serve`` on ``db``, and a client of it; SIGINT at the end, and it must
    exit cleanly."""
    async with ServeProcess(APP, store=f"sqlite:{db}", args=("--log-level", "WARNING")) as server:
        transport = HttpTransport(server.url)
        try:
            yield Client(transport, capabilities={"elicitation": {}})
        finally:
            await transport.aclose()
        assert await server.astop() == 0, server.stderr


async def operator(*words: str) -> tuple[int, str, str]:
    done = await trio.run_process(
        [sys.executable, "-m", "tritask", *words],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "TRITASK_STORE"},
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def boot_epoch(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (epoch,) = conn.execute("SELECT boot_epoch FROM tritask_metadata").fetchone()
    assert isinstance(epoch, int)
    return epoch


async def test_read_only_commands_work_beside_a_running_server(tmp_path: Path) -> None:
    db = tmp_path / "served.db"
    store = f"sqlite:{db}"
    async with running_server(db) as client:
        ids: dict[str, str] = {}
        for tool, arguments in (("echo", {"text": "hi"}), ("slow", {"seconds": 3600}), ("ask", {})):
            created = await client.call_tool(tool, arguments)
            ids[tool] = str(created["taskId"])
        with trio.fail_after(60):
            await client.wait_task(ids["echo"])
            await client.wait_task(ids["ask"], frozenset({"input_required"}))
        epoch = boot_epoch(db)

        status, out, err = await operator("tasks", "list", "--store", store, "--json")
        assert (status, err) == (0, "")
        tasks = json.loads(out)["tasks"]
        assert [(t["taskId"], t["tool"], t["status"]) for t in tasks] == [
            (ids["echo"], "echo", "completed"),
            (ids["slow"], "slow", "working"),
            (ids["ask"], "ask", "input_required"),
        ]
        leases: list[dict[str, Any]] = [t["lease"] for t in tasks[1:]]
        assert [(lease["generation"], lease["live"]) for lease in leases] == [(1, True), (1, True)]
        assert tasks[0]["lease"] is None

        status, out, err = await operator(
            "tasks", "show", "--store", store, "--json", "--", ids["ask"]
        )
        assert (status, err) == (0, "")
        shown = json.loads(out)
        assert (shown["taskId"], shown["status"], shown["inputRequests"]) == (
            ids["ask"],
            "input_required",
            ["confirm"],
        )

        status, out, err = await operator("tasks", "stats", "--store", store, "--json")
        assert (status, err) == (0, "")
        stats = json.loads(out)
        assert (stats["total"], stats["byStatus"]["working"]) == (3, 1)

        # Writing needs the file, which the server holds: one line, nothing done.
        status, out, err = await operator("tasks", "cancel", "--store", store, "--", ids["slow"])
        assert (status, out) == (1, "")
        assert err.splitlines() == [
            f"tritask: StoreLocked: {str(db)!r} is locked by another process ({db}.lock): it "
            "is open exclusively (tritask serve); stop it or share it by opening every store "
            "with exclusive=False"
        ]

        # The readers took no lock and wrote nothing: the epoch is the server's, its claims
        # still stand, and it finishes the task waiting for input once answered.
        assert boot_epoch(db) == epoch
        await client.update_task(
            ids["ask"], {"confirm": {"action": "accept", "content": {"ok": True}}}
        )
        with trio.fail_after(60):
            answered = await client.wait_task(ids["ask"])
        assert answered["status"] == "completed"
        await client.cancel_task(ids["slow"])

    # Stopped: every command opens the file again (and a read-only open still writes nothing).
    status, out, err = await operator("tasks", "list", "--store", store, "--json")
    assert (status, err) == (0, "")
    assert [t["status"] for t in json.loads(out)["tasks"]] == [
        "completed",
        "cancelled",
        "completed",
    ]
    assert boot_epoch(db) == epoch


async def test_a_read_only_open_never_creates_or_migrates(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    status, out, err = await operator("tasks", "list", "--store", f"sqlite:{missing}")
    assert (status, out) == (1, "")
    assert err.splitlines() == [
        f"tritask: StoreSchemaError: no tritask store at {str(missing)!r}: no such file"
    ]
    assert not missing.exists()


async def test_a_read_only_open_refuses_a_schema_it_would_have_to_migrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old.db"
    async with SqliteStore(old, scope="shared"):
        pass
    before = old.read_bytes()
    # This code pretends to be one migration ahead of the file.
    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.SCHEMA_VERSION + 1)
    with pytest.raises(schema.StoreSchemaError) as refused:
        async with SqliteStore(old, scope="shared", read_only=True):
            raise AssertionError("must not open")
    assert str(refused.value) == (
        f"{str(old)!r} has schema version {schema.SCHEMA_VERSION - 1}, older than this "
        f"tritask_sqlite ({schema.SCHEMA_VERSION}); a read-only open does not migrate: run "
        f"tritask migrate --store sqlite:{old} first"
    )
    assert old.read_bytes() == before


async def test_a_read_only_store_refuses_every_write(tmp_path: Path) -> None:
    db = tmp_path / "tasks.db"
    async with SqliteStore(db, scope="shared"):
        pass
    with pytest.raises(ValueError, match="a read-only store cannot be exclusive"):
        SqliteStore(db, scope="shared", read_only=True, exclusive=True)
    async with SqliteStore(db, scope="shared", read_only=True) as store:
        assert repr(store).startswith(f"<SqliteStore {str(db)!r} read-only open")
        access = await store.authorize(SimpleNamespace(principal=None), Action.CREATE, "t1")
        task = new_task("t1", await store.now(), 60_000, 100)
        work = Work(idempotency_key="t1", type="job", input={})
        with pytest.raises(ReadOnlyStore) as refused:
            await store.create(task, work, access)
        assert str(refused.value) == f"{str(db)!r} was opened read-only; this operation writes"
        with pytest.raises(ReadOnlyStore):
            await store.reap()
        assert await store.get("t1", access) is NOT_FOUND
