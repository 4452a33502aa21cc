"""PostgreSQL for the store tests: find a server, hand out unique schemas, clean up.

The server is, in order:

1. ``TRITASK_TEST_POSTGRES_DSN`` (CI and developers with a running server);
2. a throwaway cluster made with ``initdb``/``pg_ctl`` (from ``PATH`` or
   ``/usr/lib/postgresql/*/bin``) in a temporary directory, on a free loopback port, stopped and
   deleted when the session ends (as root it runs as the ``postgres`` user: initdb refuses root);
3. otherwise the tests are skipped with the reason, unless ``TRITASK_REQUIRE_POSTGRES=1``
   (CI), which turns that skip into a failure so missing evidence cannot pass silently.

Every schema a test makes is named ``tt_<run>_<n>`` (unique per run) and dropped when the test
ends; whatever a crashed test leaves behind is swept at the end of the session.

Test modules import the fixtures (``from postgres_support import pg_schemas, postgres_dsn``);
the server is shared through ``config.stash``, so it starts once however many modules use it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import attrs
import psycopg
import pytest
from psycopg import sql
from tritask_postgres import migrate

__all__ = [
    "ENV_DSN",
    "ENV_REQUIRE",
    "SchemaFactory",
    "connect",
    "pg_schemas",
    "postgres_dsn",
]

ENV_DSN = "TRITASK_TEST_POSTGRES_DSN"
ENV_REQUIRE = "TRITASK_REQUIRE_POSTGRES"


@attrs.frozen
class _Server:
    dsn: str | None
    reason: str
    run_id: str


_server_key = pytest.StashKey[_Server]()


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get(ENV_REQUIRE) == "1":
        pytest.fail(f"{ENV_REQUIRE}=1 but PostgreSQL is unavailable: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable: {reason}")


def connect(dsn: str) -> psycopg.Connection[Any]:
    """A plain autocommit connection for inspecting the database behind the store's back."""
    return psycopg.Connection.connect(dsn, autocommit=True, connect_timeout=5)


def _bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    candidates = [Path(found).parent] if found else []

    def version(path: Path) -> tuple[int, ...]:
        digits = path.parent.name.split(".")
        return tuple(int(d) for d in digits if d.isdigit())

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_cluster(config: pytest.Config) -> str:
    """initdb + pg_ctl start in a temporary directory; registers the stop with ``config``."""
    bindir = _bindir()
    if bindir is None:
        raise RuntimeError(f"{ENV_DSN} is unset and no initdb/pg_ctl was found")
    run_as: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="tritask-pg-"))
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(
                "initdb refuses to run as root and there is no postgres user"
            ) from None
        os.chown(tmp, account.pw_uid, account.pw_gid)
        run_as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    data, port = tmp / "data", _free_port()
    pg_ctl = str(bindir / "pg_ctl")

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, timeout=120, **run_as)

    def stop() -> None:
        with contextlib.suppress(Exception):
            run(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(tmp, ignore_errors=True)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--locale=C", "--no-sync")  # fmt: skip
        options = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(pg_ctl, "-D", str(data), "-l", str(tmp / "server.log"), "-o", options,
            "-w", "-t", "60", "start")  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        stop()
        detail = getattr(exc, "stderr", b"") or b""
        raise RuntimeError(f"could not start a throwaway cluster: {exc} {detail[-400:]!r}") from exc
    config.add_cleanup(stop)
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def _sweep(dsn: str, run_id: str) -> None:
    """Drop whatever schemas of this run survived their tests."""
    with contextlib.suppress(psycopg.Error), connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s)", (f"tt_{run_id}_",)
        ).fetchall()
        for (name,) in rows:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _server(config: pytest.Config) -> _Server:
    if _server_key in config.stash:
        return config.stash[_server_key]
    run_id = secrets.token_hex(4)
    dsn = os.environ.get(ENV_DSN) or None
    reason = ""
    try:
        if dsn is None:
            dsn = _start_cluster(config)
        with connect(dsn) as conn:
            conn.execute("SELECT 1")
    except (RuntimeError, psycopg.Error) as exc:
        dsn, reason = None, str(exc)
    server = _Server(dsn=dsn, reason=reason, run_id=run_id)
    config.stash[_server_key] = server
    if dsn is not None:
        config.add_cleanup(lambda: _sweep(dsn, run_id))
    return server


@pytest.fixture(scope="session")
def postgres_dsn(request: pytest.FixtureRequest) -> str:
    """The test server's DSN (skips, or fails under ``TRITASK_REQUIRE_POSTGRES=1``)."""
    server = _server(request.config)
    if server.dsn is None:
        _unavailable(server.reason)
    return server.dsn


@attrs.define
class SchemaFactory:
    """Unique schema names for one test; all of them are dropped when the test ends."""

    dsn: str
    run_id: str
    created: list[str] = attrs.field(factory=list)

    def name(self) -> str:
        """A fresh schema name (not created)."""
        name = f"tt_{self.run_id}_{secrets.token_hex(4)}"
        self.created.append(name)
        return name

    async def migrated(self) -> str:
        """A fresh schema at the latest version."""
        schema = self.name()
        await migrate(self.dsn, schema=schema)
        return schema

    def drop_all(self) -> None:
        with connect(self.dsn) as conn:
            for name in self.created:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )


@pytest.fixture
def pg_schemas(postgres_dsn: str, request: pytest.FixtureRequest) -> Iterator[SchemaFactory]:
    factory = SchemaFactory(postgres_dsn, _server(request.config).run_id)
    yield factory
    factory.drop_all()
