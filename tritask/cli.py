"""``tritask serve`` (an app over HTTP, stdio and/or WebSocket until SIGINT/SIGTERM), and the
subcommands of other rooms: ``migrate``, the operator commands, ``call`` and ``tools``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import trio

from tritask.server.app import App
from tritask.server.extension import ConfigurationError, ServeEnvironment

if TYPE_CHECKING:
    from tritask.auth import BearerAuth
    from tritask.otel import ConfiguredTelemetry

log = logging.getLogger("tritask.cli")

DEFAULT_STORE = "sqlite:tritask.db"
COMMANDS_GROUP = "tritask.commands"
"""Entry-point group through which other distributions add ``tritask`` subcommands."""


def load_app(spec: str) -> App:
    """Load ``module:attribute`` or ``path/to/file.py:attribute`` (attribute defaults to app).

    Any error while loading (a missing file, an import error, a tool registered without a
    description) stops the command with one line naming the app and the cause: the operator
    needs the reason, not a traceback through the loader.
    """
    try:
        return _load_app(spec)
    except SystemExit:
        raise
    except Exception as error:
        raise SystemExit(f"tritask: cannot load {spec}: {type(error).__name__}: {error}") from error


def _load_app(spec: str) -> App:
    target, _, attribute = spec.partition(":")
    attribute = attribute or "app"
    if target.endswith(".py") or os.sep in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise SystemExit(f"tritask: no such file: {target}")
        module_name = f"_tritask_app_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise SystemExit(f"tritask: cannot import {target}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        sys.path.insert(0, str(path.parent))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise SystemExit(f"tritask: cannot import {target}: {error}") from error
    app = getattr(module, attribute, None)
    if callable(app) and not isinstance(app, App):
        app = app()
    if not isinstance(app, App):
        raise SystemExit(f"tritask: {spec} is not a tritask.App")
    return app


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected HOST:PORT")
    try:
        number = int(port)
    except ValueError as error:
        raise argparse.ArgumentTypeError("PORT must be an integer") from error
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError("PORT must be in 0..65535")
    return host.strip("[]") or "127.0.0.1", number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError("must be a number of seconds") from error
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive, finite number of seconds")
    return number


def _connection_limit(value: str) -> int | None:
    try:
        number = int(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError("must be an integer") from error
    if number < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: no limit)")
    return number or None


def _session_limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError("must be an integer") from error
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritask", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an MCP app")
    serve.add_argument("app", nargs="?", help="module:attribute or path/to/file.py:attribute")
    serve.add_argument("--http", type=_host_port, metavar="HOST:PORT", help="Streamable HTTP")
    serve.add_argument("--stdio", action="store_true", help="serve on stdin/stdout")
    serve.add_argument("--ws", type=_host_port, metavar="HOST:PORT", help="WebSocket")
    serve.add_argument(
        "--store",
        default=os.environ.get("TRITASK_STORE", DEFAULT_STORE),
        help=f"task store URL: memory:, sqlite:PATH, postgresql://... (default {DEFAULT_STORE})",
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="accept this Host header (repeatable; default loopback only; '*' for any)",
    )
    serve.add_argument(
        "--allow-origin", action="append", default=[], metavar="ORIGIN", help="accept this Origin"
    )
    serve.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="HTTP: close a connection whose request head is not complete in time (default 5)",
    )
    serve.add_argument(
        "--max-connections",
        type=_connection_limit,
        default=1000,
        metavar="N",
        help="HTTP: open connections at most; at the cap new ones wait in the listen backlog "
        "(default 1000; 0 for no limit)",
    )
    serve.add_argument(
        "--max-sessions",
        type=_session_limit,
        default=10_000,
        metavar="N",
        help="HTTP: initialize-era (2025) sessions held at once; past it initialize gets 503 "
        "(default 10000)",
    )
    serve.add_argument(
        "--session-idle",
        type=_positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="HTTP: end an initialize-era session unused this long (default 1800)",
    )
    serve.add_argument(
        "--otel",
        action="store_true",
        default=os.environ.get("TRITASK_OTEL", "").lower() in ("1", "true", "yes"),
        help="export traces and metrics with OpenTelemetry, configured by the standard OTEL_* "
        "variables (OTLP/HTTP to localhost:4318 by default; needs tritask[otel])",
    )
    oauth = serve.add_argument_group(
        "OAuth 2.1 (HTTP; needs tritask[oauth])",
        "Require bearer tokens (JWTs) from an identity provider on every HTTP request; the "
        "Protected Resource Metadata is served at the well-known URL of --oauth-resource.",
    )
    oauth.add_argument("--oauth-issuer", metavar="URL", help="the tokens' iss (exact match)")
    oauth.add_argument("--oauth-jwks-uri", metavar="URL", help="the issuer's JWKS")
    oauth.add_argument(
        "--oauth-resource",
        metavar="URL",
        help="this server's canonical URL (https://host/mcp): the audience tokens must carry; "
        "its host is accepted in Host",
    )
    oauth.add_argument(
        "--oauth-scope",
        action="append",
        default=[],
        metavar="SCOPE",
        help="a scope every request needs (repeatable)",
    )
    oauth.add_argument(
        "--oauth-authorization-server",
        action="append",
        default=[],
        metavar="URL",
        help="advertised in the metadata (repeatable; default: the issuer)",
    )
    serve.add_argument("--log-level", default=os.environ.get("TRITASK_LOG_LEVEL", "INFO"))
    from tritask.migrate import add_migrate_command

    add_migrate_command(commands)
    from tritask.ops.parser import add_operator_commands

    add_operator_commands(commands, DEFAULT_STORE)
    from tritask.client.terminal import add_client_commands

    add_client_commands(commands)
    for entry_point in metadata.entry_points(group=COMMANDS_GROUP):
        # Subcommands of other distributions (e.g. a stress harness): each entry point is a
        # callable that adds its parser to ``commands``. A broken one is named, not hidden.
        try:
            add_command = entry_point.load()
        except Exception as error:
            raise SystemExit(
                f"tritask: the command plugin {entry_point.name!r} failed to load: {error}"
            ) from error
        add_command(commands)
    return parser


async def serve(args: argparse.Namespace) -> None:
    if args.app:
        app = load_app(args.app)
    else:
        from tritask._demo import build_demo_app

        app = build_demo_app()
    telemetry = _telemetry(app) if args.otel else None
    try:
        await _serve(app, args)
    finally:
        if telemetry is not None:
            # Flush what is still batched (the last spans and metrics) before the process ends.
            await trio.to_thread.run_sync(telemetry.shutdown)


def _telemetry(app: App) -> ConfiguredTelemetry:
    """The OpenTelemetry bridge from ``OTEL_*``, installed in ``app`` (``--otel``).

    ``tritask.otel`` is imported here only, so ``tritask`` without the extra never needs it.
    """
    try:
        otel = importlib.import_module("tritask.otel")
    except ImportError as error:
        hint = "" if "tritask[otel]" in str(error) else " (pip install 'tritask[otel]')"
        raise SystemExit(f"tritask: --otel: {error}{hint}") from None
    try:
        telemetry: ConfiguredTelemetry = otel.configure_from_environment()
    except ImportError as error:
        raise SystemExit(f"tritask: --otel: {error}") from None
    except otel.TelemetryConfigurationError as error:
        raise SystemExit(f"tritask: --otel: {error}") from None
    telemetry.install(app)
    exporters = ", ".join(telemetry.exporters) or "no exporters"
    print(f"tritask: OpenTelemetry on ({exporters})", file=sys.stderr, flush=True)
    return telemetry


STOP_SECONDS: Final = 10.0
"""After a shutdown signal, how long the transports may take to wind down before cancellation."""


async def _serve(app: App, args: argparse.Namespace) -> None:
    from tritask.transports._h11server import ServerConfig
    from tritask.transports.http import LOOPBACK_HOSTS, HttpOptions, serve_http

    if not (args.http or args.stdio or args.ws):
        args.http = ("127.0.0.1", 8000)
    env = ServeEnvironment(store_url=args.store)
    shutdown = trio.Event()
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    if "*" in args.allow_host:
        allowed_hosts = None
    elif args.allow_host:
        allowed_hosts = (*LOOPBACK_HOSTS, *args.allow_host)
    auth = _oauth(args)
    if args.ws and app.auth is not None:
        raise SystemExit(
            "tritask: --ws cannot serve an app with App(auth=...) (WebSocket has no bearer-token "
            "support: it would be unprotected); serve --http only"
        )
    if auth is not None and allowed_hosts is not None:
        resource_host = urlsplit(auth.resource).hostname
        if resource_host and resource_host not in allowed_hosts:
            allowed_hosts = (*allowed_hosts, resource_host)
    options = HttpOptions(
        allowed_hosts=allowed_hosts,
        allowed_origins=tuple(args.allow_origin) or None,
        max_sessions=args.max_sessions,
        session_idle_seconds=args.session_idle,
        auth=auth,
    )

    async def shutdown_trigger() -> None:
        await shutdown.wait()

    async with app.running(env), trio.open_nursery() as nursery:
        signals: trio.CancelScope = await nursery.start(_watch_signals, shutdown)
        if args.http:
            host, port = args.http
            binds = await nursery.start(
                lambda task_status: serve_http(
                    app,
                    host,
                    port,
                    options=options,
                    shutdown_trigger=shutdown_trigger,
                    server_config=ServerConfig(
                        header_timeout=args.header_timeout, max_connections=args.max_connections
                    ),
                    task_status=task_status,
                )
            )
            for bind in binds:
                print(
                    f"tritask: serving Streamable HTTP on {bind}/mcp", file=sys.stderr, flush=True
                )
            if auth is not None:
                print(
                    f"tritask: OAuth on: resource {auth.resource}, issuer {args.oauth_issuer}, "
                    f"metadata {auth.resource_metadata_url}",
                    file=sys.stderr,
                    flush=True,
                )
        if args.ws:
            from tritask.transports.websocket import serve_websocket

            host, port = args.ws
            url = await nursery.start(
                lambda task_status: serve_websocket(
                    app, host, port, shutdown_trigger=shutdown_trigger, task_status=task_status
                )
            )
            print(f"tritask: serving WebSocket on {url}", file=sys.stderr, flush=True)
        if args.stdio:
            from tritask.transports.stdio import serve_stdio

            print("tritask: serving stdio", file=sys.stderr, flush=True)

            async def stdio_then_stop() -> None:
                await serve_stdio(app)
                shutdown.set()

            nursery.start_soon(stdio_then_stop)
        await shutdown.wait()
        # Stop watching so the nursery can finish as soon as the transports do (a stdio EOF
        # must exit promptly); a second SIGINT now interrupts the graceful phase.
        signals.cancel()
        app.hub.close()
        print("tritask: shutting down", file=sys.stderr, flush=True)
        with trio.move_on_after(10):
            await trio.sleep(0.05)
        nursery.cancel_scope.deadline = trio.current_time() + STOP_SECONDS
    if nursery.cancel_scope.cancel_called:
        # Every transport stops on `shutdown` by itself; this is a request that outlived its
        # grace, or a transport that did not stop: worth saying, since the exit was forced.
        print(
            f"tritask: the transports did not stop within {STOP_SECONDS:g} s; cancelled them",
            file=sys.stderr,
            flush=True,
        )


def _oauth(args: argparse.Namespace) -> BearerAuth | None:
    """``BearerAuth`` with a ``JWTVerifier`` from the ``--oauth-*`` flags (``None`` without)."""
    given = {
        "--oauth-issuer": args.oauth_issuer,
        "--oauth-jwks-uri": args.oauth_jwks_uri,
        "--oauth-resource": args.oauth_resource,
    }
    if not any(given.values()) and not args.oauth_scope and not args.oauth_authorization_server:
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise SystemExit(f"tritask: OAuth needs {', '.join(missing)} as well")
    if args.ws:
        raise SystemExit(
            "tritask: --ws cannot be served with OAuth (WebSocket has no bearer-token "
            "support); serve --http only"
        )
    from tritask.auth import BearerAuth, JWTVerifier

    try:
        return BearerAuth(
            resource=args.oauth_resource,
            authorization_servers=args.oauth_authorization_server or [args.oauth_issuer],
            verifier=JWTVerifier(args.oauth_issuer, args.oauth_jwks_uri),
            required_scopes=args.oauth_scope,
        )
    except (ValueError, TypeError, ImportError) as error:
        raise SystemExit(f"tritask: OAuth: {error}") from None


async def _watch_signals(
    shutdown: trio.Event, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with (
        trio.CancelScope() as scope,
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        task_status.started(scope)
        async for _ in signals:
            shutdown.set()
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    from tritask.client.terminal import split_server_command

    # `tritask call TOOL k=v -- COMMAND …`: the stdio server's command is not ours to parse.
    words, server_command = split_server_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(words)
    args.server_command = server_command
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler = getattr(args, "handler", None)
    if handler is not None:
        return int(handler(args) or 0)
    if args.command == "serve":
        try:
            trio.run(serve, args)
        except ConfigurationError as error:
            # Refused at start, before anything was opened or bound: one line, no traceback.
            raise SystemExit(f"tritask: cannot serve {args.app or 'the demo'}: {error}") from None
        return 0
    parser.error(f"unknown command {args.command}")
