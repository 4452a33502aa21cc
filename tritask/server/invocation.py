"""The tool-invocation pipeline: from a ``tools/call``'s name and arguments to its result.

One pipeline, two callers, so a tool behaves the same however it is reached:

* the ``Dispatcher`` serves a request with :func:`call_tool`: lookup, ``App.authorize``, the
  argument contract (:func:`prepare_tool_call`), the extensions' ``around_tool_call`` chain
  (the Tasks extension may store the call as a task here), then :func:`run_tool`;
* an executor of stored work (the Tasks extension's ``ToolCallExecutor``, on every attempt and
  after a restart) checks the persisted arguments with :func:`prepare_tool_call` and runs them
  with :func:`run_tool`, without the request-only steps (authorization happened when the task
  was created; the extension chain already chose the task).

:func:`run_tool` calls the function (:func:`invoke`), turns a ``ToolError`` into an ``isError``
result (a ``RetryLater`` inside a task is left to the task runtime), an ``InputRequired`` into
an MRTR answer (:func:`input_required_result`), and shapes every result (:func:`shape`). This
module depends on ``App`` (its registries) and nothing routes through it back: ``App`` builds no
dispatcher and runs no handler.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tritask.jsonrpc import InternalError, InvalidParams, JsonRpcError, JSONValue
from tritask.protocol import headers as hdr
from tritask.protocol.capabilities import require_input_request
from tritask.protocol.meta import SERVER_INFO_KEY
from tritask.protocol.versions import INPUT_REQUIRED_METHODS
from tritask.server.app import App, ToolDef
from tritask.server.context import Context
from tritask.server.extension import CallNext, ToolCall
from tritask.server.mrtr import InputRequired
from tritask.server.results import (
    InvalidResult,
    RetryLater,
    ToolError,
    tool_error_result,
    tool_result,
)
from tritask.server.schema import validation_errors

__all__ = [
    "call_tool",
    "find_tool",
    "input_required_result",
    "invoke",
    "name_param",
    "prepare_tool_call",
    "run_tool",
    "shape",
]

log = logging.getLogger("tritask.server")


def name_param(method: str, params: Mapping[str, JSONValue]) -> str | None:
    """The name a core method's request is about (``params.name`` of ``tools/call``...)."""
    source = hdr.CORE_NAME_SOURCES.get(method)
    value = params.get(source) if source else None
    return value if isinstance(value, str) else None


def shape(app: App, result: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """Every result carries ``resultType`` and names the server in ``_meta``."""
    shaped = dict(result)
    shaped.setdefault("resultType", "complete")
    meta = shaped.get("_meta")
    merged: dict[str, JSONValue] = dict(meta) if isinstance(meta, dict) else {}
    merged[SERVER_INFO_KEY] = app.server_info
    shaped["_meta"] = merged
    return shaped


def input_required_result(value: InputRequired, ctx: Context) -> dict[str, JSONValue]:
    """Shape an ``InputRequired``: only on MRTR methods, only for declared capabilities."""
    if ctx.method not in INPUT_REQUIRED_METHODS:
        raise InternalError(f"{ctx.method} cannot answer with input_required")
    for request in value.input_requests.values():
        require_input_request(dict(ctx.client_capabilities), request)
    result: dict[str, JSONValue] = {"resultType": "input_required"}
    if value.input_requests:
        result["inputRequests"] = dict(value.input_requests)
    if ctx.session is not None:
        # An initialize-era session answers the inputs itself (server-initiated requests,
        # tritask.server.legacy): the state never leaves the process, so it is not sealed.
        if value.state is not None:
            result["requestState"] = value.state
    elif value.state is not None:
        result["requestState"] = ctx.app.sealer.seal(
            value.state,
            method=ctx.method,
            name=name_param(ctx.method, ctx.params),
            principal=ctx.principal,
        )
    return result


async def invoke(
    fn: Callable[..., Awaitable[Any]],
    context_param: str | None,
    ctx: Context,
    arguments: Mapping[str, Any],
) -> Any:
    """``fn(**arguments)``, with ``ctx`` as its context parameter when it takes one."""
    kwargs = dict(arguments)
    if context_param is not None:
        kwargs[context_param] = ctx
    return await fn(**kwargs)


def find_tool(app: App, name: JSONValue) -> ToolDef:
    """The registered tool ``name`` (``-32602`` for a missing or unknown name)."""
    if not isinstance(name, str) or not name:
        raise InvalidParams("tools/call requires a non-empty string params.name")
    tool = app.tools.get(name)
    if tool is None:
        raise InvalidParams(f"Unknown tool: {name}", {"name": name})
    return tool


def prepare_tool_call(
    app: App, name: JSONValue, arguments: JSONValue, params: Mapping[str, JSONValue]
) -> ToolCall | dict[str, JSONValue]:
    """Look up and validate: a ``ToolCall``, or the ``isError`` result for bad arguments.

    The tool-argument contract (``tritask.server.arguments``) in order: names the function
    cannot take are ``-32602`` (generated schemas), then schema errors are an ``isError``
    result (not yet shaped), then a missing parameter is ``-32602`` and extras an explicit
    schema allows are dropped. It runs before the extensions' ``around_tool_call``, so no task
    is created from arguments its tool cannot take, and again when task work is executed.
    """
    tool = find_tool(app, name)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidParams("tools/call params.arguments must be an object")
    tool.contract.refuse_unknown(arguments)
    if arguments:
        errors = validation_errors(tool.validator, arguments)
    else:
        errors = list(tool.no_argument_errors)
    if errors:
        return tool_error_result(f"Invalid arguments for tool {tool.name}: " + "; ".join(errors))
    admitted = tool.contract.admit(arguments)
    return ToolCall(tool=tool, arguments=admitted, params=params)


async def run_tool(call: ToolCall, ctx: Context) -> dict[str, JSONValue]:
    """Execute a validated tool call and shape its result (what a direct call returns)."""
    app = ctx.app
    try:
        value = await invoke(call.tool.fn, call.tool.context_param, ctx, call.arguments)
    except ToolError as error:
        if isinstance(error, RetryLater) and ctx.detached:
            raise  # inside a task the runtime decides about retries (ToolCallExecutor)
        return shape(app, tool_error_result(str(error)))
    except ExceptionGroup as group:
        # A ToolError raised inside a tool's own nursery arrives wrapped (strict groups);
        # it is still the tool's domain error when nothing else is in the group.
        tool_errors, rest = group.split(ToolError)
        if tool_errors is None or rest is not None:
            # Likewise a group of JSON-RPC errors (each child missing the same capability)
            # is still that error, not an internal one.
            protocol_errors, others = group.split(JsonRpcError)
            if protocol_errors is not None and others is None:
                raise _first_leaf(protocol_errors) from group
            raise
        first = tool_errors.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        if isinstance(first, RetryLater) and ctx.detached:
            raise first from None
        return shape(app, tool_error_result(str(first)))
    if isinstance(value, InputRequired):
        return shape(app, input_required_result(value, ctx))
    try:
        return shape(app, tool_result(value))
    except InvalidResult as error:
        log.error("tool %s returned an invalid result: %s", call.tool.name, error)
        raise InternalError("Tool returned an invalid result") from error


async def call_tool(params: Mapping[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
    """A ``tools/call`` request: lookup, the tool's scopes, authorize, prepare, the extension
    chain, run (``InsufficientScope`` before anything runs: HTTP 403 on HTTP)."""
    app = ctx.app
    tool = find_tool(app, params.get("name"))
    if tool.required_scopes:
        ctx.require_scopes(*tool.required_scopes)
    if app.authorize is not None:
        await app.authorize(ctx, "tool", tool.name)
    prepared = prepare_tool_call(app, tool.name, params.get("arguments"), params)
    if not isinstance(prepared, ToolCall):
        return prepared
    chain: CallNext = run_tool
    for extension in reversed(list(app.extensions.values())):
        chain = _wrap(extension.around_tool_call, chain)
    return await chain(prepared, ctx)


def _first_leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    first: Exception | BaseExceptionGroup[Exception] = group.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def _wrap(
    hook: Callable[[ToolCall, Context, CallNext], Awaitable[dict[str, JSONValue]]], inner: CallNext
) -> CallNext:
    async def call(call: ToolCall, ctx: Context) -> dict[str, JSONValue]:
        return await hook(call, ctx, inner)

    return call
