"""``python -m stress fuzz``: generated valid-envelope requests against a ``tritask serve``.

It starts ``python -m tritask serve APP --store STORE`` (Streamable HTTP on a free loopback
port, or ``--stdio``), sends ``--requests`` generated requests (plus its own discovery, tour and
settling requests, counted apart), settles every task it created, checks the server's log for
tracebacks, stops the server with SIGINT and prints one JSON report. Exit status 0 only when
nothing broke: no 5xx, no ``-32603``, no task failed with an internal error but the fixture's
designed crash, no unexpected traceback, and the server answered afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from stress.common import Checks, make_report
from stress.fuzz.auth import Credentials, standard_faults
from stress.fuzz.drivers import HttpDriver, stdio_process
from stress.fuzz.eras import MODERN, Era, legacy_era
from stress.fuzz.run import fuzz
from stress.fuzz.session import Fuzzer, tracebacks

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = f"{ROOT / 'examples' / 'conformance_fixture.py'}:app"


def register_fuzz(commands: Any, common: Any) -> None:
    parser = commands.add_parser(
        "fuzz", help="generated valid-envelope requests against a tritask serve process"
    )
    common(parser)
    parser.add_argument("--requests", "-n", type=int, default=2000, help="generated requests")
    parser.add_argument("--store", default="sqlite:", help="sqlite:PATH (default: a temp file)")
    parser.add_argument("--app", default=FIXTURE, help="the app to serve (the conformance fixture)")
    parser.add_argument("--transport", choices=["http", "stdio"], default="http")
    parser.add_argument(
        "--era",
        choices=["modern", "legacy"],
        default="modern",
        help="2026-07-28 envelopes, or an initialize-era session (version drawn from --seed)",
    )
    parser.add_argument(
        "--oauth",
        action="store_true",
        help="auth on (HTTP): serve with --oauth-* flags against a loopback authorization "
        "server; every request carries a bearer token, every 7th generated one a broken "
        "credential that must be refused as RFC 6750 says (needs tritask[oauth])",
    )
    parser.set_defaults(handler=_handle_fuzz)


def _handle_fuzz(args: argparse.Namespace) -> int:
    if args.requests <= 0:
        raise SystemExit("--requests must be positive")
    report = run_fuzz(
        requests=args.requests,
        store=args.store,
        app=args.app,
        transport=args.transport,
        seed=args.seed,
        era=args.era,
        oauth=args.oauth,
    )
    if args.json:
        from stress import cli  # its dump_report, which the stress tests capture

        cli.dump_report(report)
    else:
        inv = report["invariants"]
        print(f"fuzz: {'ok' if report['ok'] else 'FAILED'}", file=sys.stderr)
        for key in ("generatedRequests", "requests", "httpStatuses", "errorCodes"):
            print(f"  {key}: {inv.get(key)}", file=sys.stderr)
        for key in ("tasksCreated", "tasksByFinalStatus", "tasksFailedInternal", "credentials"):
            print(f"  {key}: {inv.get(key)}", file=sys.stderr)
        unexpected = inv.get("tasksFailedInternalUnexpected")
        print(f"  tasksFailedInternalUnexpected: {unexpected}", file=sys.stderr)
        print(f"  tracebacks: {inv.get('tracebacks')}", file=sys.stderr)
        for failure in inv["failures"]:
            print(f"  FAILURE {failure}", file=sys.stderr)
    return 0 if report["ok"] else 1


def run_fuzz(
    *,
    requests: int,
    store: str,
    app: str = FIXTURE,
    transport: str = "http",
    seed: int = 0,
    era: str = "modern",
    oauth: bool = False,
) -> dict[str, Any]:
    """Serve ``app`` in a child process, fuzz it, and build the report."""
    if oauth and transport != "http":
        raise SystemExit("--oauth needs --transport http (authorization is HTTP-only)")
    chosen: Era = legacy_era(seed) if era == "legacy" else MODERN
    outcome: dict[str, Any] = {}
    started = time.perf_counter()

    async def main() -> None:
        with _store_path(store) as store_url:
            command = [sys.executable, "-m", "tritask", "serve", app, "--store", store_url]
            env = dict(os.environ)
            if transport == "stdio":
                async with stdio_process([*command, "--stdio"], env=env) as (driver, stderr):
                    fuzzer = Fuzzer(driver, chosen, budget=requests)
                    await fuzz(fuzzer, examples=requests, shrink=False, seed=seed, fail_fast=False)
                outcome["fuzzer"], outcome["log"] = fuzzer, b"".join(stderr)
                return
            outcome["fuzzer"], outcome["log"] = await _fuzz_http(
                command, env, requests, seed, chosen, oauth
            )

    error = None
    try:
        trio.run(main)
    except Exception as exc:  # the report says why; the exit status says it failed
        error = f"{type(exc).__name__}: {exc}"
    checks = Checks()
    timings = {"processSeconds": round(time.perf_counter() - started, 3)}
    params = {"requests": requests, "store": store, "transport": transport, "seed": seed}
    params["era"] = chosen.name
    params["oauth"] = oauth
    fuzzer = outcome.get("fuzzer")
    if fuzzer is not None:
        report = fuzzer.ledger.report()
        for key, value in report.items():
            if key != "violations":
                checks.figure(key, value)
        log_text = outcome["log"].decode("utf-8", "replace")
        found, expected = tracebacks(log_text)
        checks.figure("tracebacks", {"found": found, "fixtureCrashes": expected})
        checks.check("generated all requests", report["generatedRequests"] == requests)
        checks.check("no 5xx", not any(int(s) >= 500 for s in report["httpStatuses"]))
        # The legacy era calls protocol_error_job directly: its -32603 is by design, and any
        # other -32603 is a violation (the session's checks tell them apart).
        checks.check("no -32603", era == "legacy" or "-32603" not in report["errorCodes"])
        checks.check(
            "no task failed with an internal error",
            report["tasksFailedInternalUnexpected"] == 0,
        )
        checks.check("no unexpected traceback", found == expected, log_text[-2000:])
        checks.check("shut down cleanly", "tritask: shutting down" in log_text)
        checks.check("no violation", not report["violations"], "; ".join(report["violations"][:5]))
        if fuzzer.credentials is not None:
            refused = dict(sorted(fuzzer.credentials.refused.items()))
            checks.figure("credentials", {"faultsRefused": refused})
            checks.check(
                "broken credentials were sent and refused",
                sum(refused.values()) >= requests // fuzzer.credentials.every - 1,
            )
    return make_report("tritask.stress.fuzz", params, checks, timings, error=error)


class _store_path:
    """``sqlite:`` alone means a fresh file in a temporary directory, removed afterwards."""

    def __init__(self, store: str) -> None:
        self.store = store
        self._dir: Any = None

    def __enter__(self) -> str:
        if self.store != "sqlite:":
            return self.store
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="tritask-fuzz-")
        return f"sqlite:{Path(self._dir.name) / 'tasks.db'}"

    def __exit__(self, *exc: object) -> None:
        if self._dir is not None:
            self._dir.cleanup()


async def _fuzz_http(
    command: list[str], env: dict[str, str], requests: int, seed: int, era: Era, oauth: bool
) -> tuple[Fuzzer, bytes]:
    stderr = bytearray()
    async with contextlib.AsyncExitStack() as stack:
        bind = "127.0.0.1:0"
        credentials: Credentials | None = None
        if oauth:
            from tritask.testing.oauth import free_port, running_authorization_server

            server = await stack.enter_async_context(running_authorization_server())
            port = free_port()
            resource = f"http://127.0.0.1:{port}/mcp"
            bind = f"127.0.0.1:{port}"
            command = [
                *command,
                "--oauth-issuer", server.issuer,
                "--oauth-jwks-uri", f"{server.issuer}/jwks",
                "--oauth-resource", resource,
                "--oauth-scope", "mcp",
            ]  # fmt: skip
            tokens = [server.mint(aud=resource, sub="fuzzer", exp_in=3600) for _ in range(3)]
            faults = standard_faults(
                server.mint(aud=resource, exp_in=-600), server.mint(aud="https://elsewhere/mcp")
            )
            credentials = Credentials(tokens, faults)
        nursery = await stack.enter_async_context(trio.open_nursery())
        process = await trio.lowlevel.open_process(
            [*command, "--http", bind], stderr=subprocess.PIPE, env=env
        )
        ready = trio.Event()

        async def collect() -> None:
            assert process.stderr is not None
            while chunk := await process.stderr.receive_some(65536):
                stderr.extend(chunk)
                if b"/mcp\n" in stderr:
                    ready.set()
            ready.set()

        nursery.start_soon(collect)
        try:
            with trio.fail_after(60):
                await ready.wait()
            marker = b"serving Streamable HTTP on "
            if marker not in stderr:
                raise RuntimeError(f"the server did not start: {bytes(stderr[-2000:])!r}")
            url = bytes(stderr).split(marker, 1)[1].split(b"\n", 1)[0].decode()
            async with httpx.AsyncClient(timeout=None) as client:
                fuzzer = Fuzzer(
                    HttpDriver(client, url), era, budget=requests, credentials=credentials
                )
                await fuzz(fuzzer, examples=requests, shrink=False, seed=seed, fail_fast=False)
        finally:
            process.send_signal(signal.SIGINT)
            with trio.move_on_after(20) as waited:
                await process.wait()
            if waited.cancelled_caught:
                process.kill()
                await process.wait()
    return fuzzer, bytes(stderr)
