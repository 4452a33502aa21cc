"""``tritask call`` and ``tritask tools``: the client from a terminal.

``tritask call URL TOOL key=value …`` calls a tool and prints its result; with a stdio server
the server's command comes last, after ``--``: ``tritask call TOOL key=value … -- COMMAND …``.
While a task runs its status changes (and a sync call's progress) are shown on stderr as they
arrive; an elicitation is asked on the terminal, field by field; Ctrl-C cancels the task
(``tasks/cancel``) before exiting. The result goes to stdout: its text, or with ``--json`` the
whole ``CallToolResult``.

Arguments are ``key=value``. The value is read with the tool's ``inputSchema``: a ``string``
property takes the text as is, other types parse it as JSON (``count=3``, ``on=true``,
``tags=["a","b"]``); a key the schema does not describe is JSON when it parses, text otherwise.

Exit status: 0 for a result, 1 for a tool error (``isError``), a failed or cancelled task, or an
error answer from the server, 2 for a usage error, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TextIO

import trio

from tritask.client.client import Client
from tritask.client.connect import connect
from tritask.client.errors import ClientError, RpcError, TaskCancelled
from tritask.client.model import InputRequest, Progress, TaskState, Tool, ToolResult
from tritask.jsonrpc import JSONValue

CLIENT_COMMANDS: Final = frozenset({"call", "tools"})
"""Commands whose server command, for stdio, follows ``--``."""


class UsageError(Exception):
    """A mistake in the command line (exit status 2)."""


def add_client_commands(commands: Any) -> None:
    """Register ``call`` and ``tools`` on the ``tritask`` subparsers."""
    call = commands.add_parser(
        "call",
        help="call a tool of an MCP server and print its result",
        description="tritask call URL TOOL key=value ...  |  tritask call TOOL key=value ... "
        "-- COMMAND ...  (a stdio server started by COMMAND)",
    )
    call.add_argument("words", nargs="*", metavar="URL TOOL key=value", help="what to call")
    call.add_argument("--json", action="store_true", help="print the whole result as JSON")
    call.add_argument(
        "--no-input", action="store_true", help="decline input requests instead of asking"
    )
    call.add_argument("--poll", action="store_true", help="poll tasks/get instead of listening")
    _common(call)
    call.set_defaults(handler=run_call)

    tools = commands.add_parser(
        "tools",
        help="list the tools of an MCP server",
        description="tritask tools URL  |  tritask tools -- COMMAND ...",
    )
    tools.add_argument("words", nargs="*", metavar="URL")
    tools.add_argument("--json", action="store_true", help="print the tool definitions as JSON")
    _common(tools)
    tools.set_defaults(handler=run_tools)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME:VALUE", help="HTTP header"
    )
    parser.add_argument(
        "--auth",
        default=os.environ.get("TRITASK_AUTHORIZATION"),
        metavar="VALUE",
        help="Authorization header value (default $TRITASK_AUTHORIZATION)",
    )
    parser.add_argument(
        "--root", action="append", default=[], metavar="URI", help="a root the server may list"
    )
    parser.add_argument(
        "--server-stderr",
        action="store_true",
        help="show a stdio server's own log (hidden by default)",
    )
    parser.add_argument("--log-level", default=os.environ.get("TRITASK_LOG_LEVEL", "WARNING"))


def split_server_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """``call``/``tools`` arguments before ``--``, and the stdio server command after it."""
    words = list(argv)
    if words and words[0] in CLIENT_COMMANDS and "--" in words:
        cut = words.index("--")
        return words[:cut], words[cut + 1 :]
    return words, None


# -- arguments ---------------------------------------------------------------------------


def parse_assignments(pairs: Sequence[str], tool: Tool | None) -> dict[str, JSONValue]:
    """``key=value`` words as tool arguments, typed by the tool's ``inputSchema``."""
    properties: Mapping[str, Any] = {}
    if tool is not None and isinstance(tool.input_schema.get("properties"), dict):
        properties = tool.input_schema["properties"]
    arguments: dict[str, JSONValue] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"expected key=value, got {pair!r}")
        schema = properties.get(key)
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string":
            arguments[key] = text
        elif kind is None:
            try:
                arguments[key] = json.loads(text)
            except ValueError:
                arguments[key] = text
        else:
            try:
                arguments[key] = json.loads(text)
            except ValueError as error:
                raise UsageError(f"{key} is {kind}: {text!r} is not JSON ({error})") from None
    return arguments


# -- the terminal ------------------------------------------------------------------------


class Terminal:
    """Where status goes (stderr) and where questions are asked (stdin)."""

    def __init__(self, err: TextIO, ask: Callable[[str], str | None], *, enabled: bool) -> None:
        self.err = err
        self._ask = ask
        self.asking = enabled
        self.live = err.isatty()
        self._partial = False

    def status(self, line: str) -> None:
        self._end_partial()
        print(line, file=self.err, flush=True)

    def progress(self, line: str) -> None:
        if self.live:
            self.err.write("\r\x1b[K" + line)
            self.err.flush()
            self._partial = True
        else:
            print(line, file=self.err, flush=True)

    def _end_partial(self) -> None:
        if self._partial:
            self.err.write("\n")
            self._partial = False

    async def ask(self, prompt: str) -> str | None:
        """One line from the user (``None`` at end of input)."""
        self._end_partial()
        self.err.write(prompt)
        self.err.flush()
        return await trio.to_thread.run_sync(self._ask, prompt, abandon_on_cancel=True)


def _read_line(prompt: str) -> str | None:
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def _describe(state: TaskState) -> str:
    line = f"task {state.task_id}: {state.status}"
    if state.status_message:
        line += f" ({state.status_message})"
    return line


class Questions:
    """Elicitation on a terminal: the message, then each field of the requested schema."""

    def __init__(self, terminal: Terminal) -> None:
        self.terminal = terminal

    async def elicit(self, request: InputRequest) -> Mapping[str, JSONValue]:
        terminal = self.terminal
        params = request.params
        if not terminal.asking:
            terminal.status(f"declining input {request.key!r}: {request.message or ''}")
            return {"action": "decline"}
        if params.get("mode") == "url":
            terminal.status(f"{request.message or 'Open this URL'}: {params.get('url')}")
            answer = await terminal.ask("Done? [y/N] ")
            return {"action": "accept" if _yes(answer, False) else "decline"}
        terminal.status(f"? {request.message or request.key}")
        schema = params.get("requestedSchema") or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
        content: dict[str, JSONValue] = {}
        for name, field in (properties or {}).items():
            if not isinstance(field, dict):
                continue
            value = await self._field(name, field, name in required)
            if value is _CANCEL:
                return {"action": "cancel"}
            if value is not _SKIP:
                content[name] = value
        return {"action": "accept", "content": content}

    async def _field(self, name: str, field: Mapping[str, Any], required: bool) -> Any:
        kind = field.get("type")
        choices = _choices(field)
        label = field.get("title") or field.get("description") or name
        default = field.get("default")
        hint = f" {choices}" if choices else (" [y/n]" if kind == "boolean" else f" ({kind})")
        shown = "" if default is None else f" [{json.dumps(default)}]"
        while True:
            answer = await self.terminal.ask(f"  {label}{hint}{shown}: ")
            if answer is None:
                return _CANCEL
            answer = answer.strip()
            if answer == "":
                if default is not None:
                    return default
                if not required:
                    return _SKIP
                self.terminal.status("  (required)")
                continue
            try:
                return _convert(answer, kind, choices)
            except ValueError as error:
                self.terminal.status(f"  {error}")


_SKIP = object()
_CANCEL = object()


def _choices(field: Mapping[str, Any]) -> list[str]:
    if isinstance(field.get("enum"), list):
        return [str(v) for v in field["enum"]]
    options = field.get("oneOf") or field.get("anyOf")
    if isinstance(options, list):
        return [str(o["const"]) for o in options if isinstance(o, dict) and "const" in o]
    return []


def _yes(answer: str | None, default: bool) -> bool:
    if answer is None or not answer.strip():
        return default
    return answer.strip().lower() in ("y", "yes", "true", "1")


def _convert(answer: str, kind: Any, choices: list[str]) -> JSONValue:
    if choices and answer not in choices:
        raise ValueError(f"choose one of {', '.join(choices)}")
    if kind == "boolean":
        lowered = answer.lower()
        if lowered in ("y", "yes", "true", "1"):
            return True
        if lowered in ("n", "no", "false", "0"):
            return False
        raise ValueError("answer y or n")
    if kind == "integer":
        try:
            return int(answer)
        except ValueError:
            raise ValueError("an integer, please") from None
    if kind == "number":
        try:
            return float(answer)
        except ValueError:
            raise ValueError("a number, please") from None
    return answer


# -- output ------------------------------------------------------------------------------


def render_result(result: ToolResult) -> str:
    """What a person reads: the text items, a line per other item, else the structured data."""
    lines: list[str] = []
    for item in result.content:
        kind = item.get("type")
        if kind == "text" and isinstance(item.get("text"), str):
            lines.append(item["text"])
        elif kind in ("image", "audio"):
            lines.append(
                f"[{kind} {item.get('mimeType', '?')}, {len(str(item.get('data', '')))} "
                "base64 characters]"
            )
        elif kind == "resource":
            resource = item.get("resource") or {}
            text = resource.get("text") if isinstance(resource, dict) else None
            uri = resource.get("uri") if isinstance(resource, dict) else None
            lines.append(f"[resource {uri}]" + (f"\n{text}" if isinstance(text, str) else ""))
        elif kind == "resource_link":
            lines.append(f"[link {item.get('uri')}]")
        else:
            lines.append(json.dumps(item, ensure_ascii=False))
    if not lines and result.structured_content is not None:
        lines.append(json.dumps(result.structured_content, indent=2, ensure_ascii=False))
    return "\n".join(lines)


# -- the commands ------------------------------------------------------------------------


def _target(words: list[str], server_command: list[str] | None) -> tuple[Any, list[str]]:
    if server_command is not None:
        if not server_command:
            raise UsageError("nothing after --: give the command that starts the server")
        return server_command, words
    if not words:
        raise UsageError("give the server URL (or a command after --)")
    return words[0], words[1:]


def _options(args: argparse.Namespace, terminal: Terminal | None = None) -> dict[str, Any]:
    headers: dict[str, str] = {}
    for header in args.header:
        name, sep, value = header.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"expected NAME:VALUE, got {header!r}")
        headers[name.strip()] = value.strip()
    options: dict[str, Any] = {
        "headers": headers or None,
        "auth": args.auth,
        "stderr": None if args.server_stderr else subprocess.DEVNULL,
        "client_info": {"name": "tritask-cli", "version": _version()},
    }
    if args.root:
        options["roots"] = [{"uri": uri} for uri in args.root]
    if terminal is not None:
        options["elicitation"] = Questions(terminal).elicit
    return options


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tritask")
    except metadata.PackageNotFoundError:
        return "0"


def _fail(message: str) -> int:
    print(f"tritask: {message}", file=sys.stderr, flush=True)
    return 1


def _quiet_broken_pipe(
    run: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """``tritask tools URL | head``: a reader that stops early is not an error worth a trace."""

    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush is quiet
            return 1

    return guarded


@_quiet_broken_pipe
def run_tools(args: argparse.Namespace) -> int:
    try:
        target, rest = _target(args.words, args.server_command)
        if rest:
            raise UsageError(f"unexpected arguments: {' '.join(rest)}")
        return trio.run(_tools, target, args)
    except UsageError as error:
        print(f"tritask tools: {error}", file=sys.stderr)
        return 2


async def _tools(target: Any, args: argparse.Namespace) -> int:
    try:
        async with connect(target, **_options(args)) as client:
            tools = await client.list_tools()
            rejected = dict(client.rejected_tools)
    except ClientError as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps([tool.raw for tool in tools], indent=2, ensure_ascii=False))
        return 0
    width = max((len(tool.name) for tool in tools), default=0)
    for tool in tools:
        summary = (tool.description or "").strip().splitlines()
        print(f"{tool.name:<{width}}  {summary[0] if summary else ''}".rstrip())
    for name, reason in rejected.items():
        print(f"tritask: left out {name}: {reason}", file=sys.stderr)
    return 0


@_quiet_broken_pipe
def run_call(args: argparse.Namespace) -> int:
    try:
        target, rest = _target(args.words, args.server_command)
        if not rest:
            raise UsageError("give the tool to call")
        tool, assignments = rest[0], rest[1:]
        for pair in assignments:
            if "=" not in pair:
                raise UsageError(f"expected key=value, got {pair!r}")
        terminal = Terminal(sys.stderr, _read_line, enabled=not args.no_input)
        return trio.run(_call, target, tool, assignments, args, terminal)
    except UsageError as error:
        print(f"tritask call: {error}", file=sys.stderr)
        return 2


async def _call(
    target: Any, name: str, assignments: list[str], args: argparse.Namespace, terminal: Terminal
) -> int:
    try:
        async with connect(
            target, listen_for_tasks=not args.poll, **_options(args, terminal)
        ) as client:
            return await _call_on(client, name, assignments, args, terminal)
    except UsageError:
        raise
    except ClientError as error:
        return _fail(str(error))


async def _call_on(
    client: Client, name: str, assignments: list[str], args: argparse.Namespace, terminal: Terminal
) -> int:
    tools = {tool.name: tool for tool in await _listed(client)}
    arguments = parse_assignments(assignments, tools.get(name))

    def progress(update: Progress) -> None:
        total = f"/{update.total:g}" if update.total is not None else ""
        message = f" {update.message}" if update.message else ""
        terminal.progress(f"progress {update.progress:g}{total}{message}")

    call = await client.start_tool(name, arguments, on_progress=progress)
    if call.task is not None:
        terminal.status(f"task {call.task.task_id}: created")
    try:
        result = await call.result(on_state=lambda state: terminal.status(_describe(state)))
    except KeyboardInterrupt:
        if call.task is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await call.cancel()
                terminal.status(f"task {call.task.task_id}: cancel requested")
        return 130
    except TaskCancelled as cancelled:
        return _fail(f"task {cancelled.task_id} was cancelled")
    except RpcError as error:
        if args.json:
            print(json.dumps({"error": error.to_error()}, indent=2, ensure_ascii=False))
        return _fail(str(error))
    if args.json:
        print(json.dumps(result.raw, indent=2, ensure_ascii=False))
    else:
        text = render_result(result)
        if text:
            print(text, flush=True)
    return 1 if result.is_error else 0


async def _listed(client: Client) -> list[Tool]:
    try:
        return await client.list_tools()
    except RpcError:
        return []  # typing falls back to "JSON when it parses"
