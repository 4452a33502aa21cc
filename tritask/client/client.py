"""The 2026-07-28 client: stateless requests, MRTR rounds, tasks followed to their end.

Every request carries its own ``_meta`` (protocol version, the capabilities this client can
honour, its identity), exactly as the revision requires; nothing depends on an earlier request.
What the client keeps between requests is only what makes requests correct: the protocol
version it settled on (after a ``-32022`` naming one it speaks, it retries once with it) and,
over Streamable HTTP, the tool definitions that say which arguments travel as
``Mcp-Param-*`` headers (fetched when a call needs them, refreshed after a ``-32020``).

Input requests reach the application's handlers in both of their forms: the rounds of an
``input_required`` result (the original request is retried with a new id, the answers and the
``requestState`` echoed verbatim, never reused for another request) and the ``inputRequests``
of a task waiting in ``input_required`` (answered with ``tasks/update``). The client declares
``elicitation``, ``sampling`` and ``roots`` only when it has a handler for them, so a server
never asks for what nobody can answer.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeAlias

from tritask.client.errors import (
    CancelledByServer,
    ClientError,
    HeaderMismatchError,
    InputNotHandled,
    ProtocolViolation,
    RpcError,
    ToolRejected,
    UnsupportedVersionError,
    error_from,
)
from tritask.client.model import (
    TASKS_EXTENSION,
    Completion,
    InputRequest,
    Notification,
    Progress,
    PromptResult,
    ResourceResult,
    ServerInfo,
    TaskState,
    Tool,
    ToolResult,
    input_requests,
    result_type,
)
from tritask.client.param_headers import (
    InvalidAnnotation,
    declared_param_headers,
    param_header_pairs,
)
from tritask.client.tasks import TaskHandle, ToolCall
from tritask.client.transport import Exchange, Transport
from tritask.jsonrpc import JSONRPC_VERSION, JSONValue
from tritask.protocol.headers import CORE_NAME_SOURCES, encode_header_value
from tritask.protocol.meta import (
    CLIENT_CAPABILITIES_KEY,
    CLIENT_INFO_KEY,
    LOG_LEVEL_KEY,
    PROTOCOL_VERSION_KEY,
)
from tritask.protocol.versions import LATEST_VERSION, SUPPORTED_VERSIONS

log = logging.getLogger("tritask.client")

InputHandler: TypeAlias = Callable[[InputRequest], Awaitable[Mapping[str, JSONValue]]]
"""Answers one input request: an ``ElicitResult``, a ``CreateMessageResult`` or a
``ListRootsResult`` (as JSON)."""

Roots: TypeAlias = Sequence[Mapping[str, JSONValue]] | InputHandler
"""A fixed list of roots (``{"uri": …, "name": …}``) or a handler of ``roots/list``."""

NAME_SOURCES: Final[Mapping[str, str]] = {
    **CORE_NAME_SOURCES,
    "tasks/get": "taskId",
    "tasks/update": "taskId",
    "tasks/cancel": "taskId",
}
"""The body parameter each ``Mcp-Name`` header mirrors (SEP-2243; SEP-2663 for tasks)."""

DEFAULT_CLIENT_INFO: Final[Mapping[str, JSONValue]] = {"name": "tritask-client", "version": "0.1.0"}
DEFAULT_MAX_ROUNDS: Final = 16


class Client:
    """Requests to one server over one ``Transport`` (use ``tritask.client.connect``)."""

    def __init__(
        self,
        transport: Transport,
        *,
        client_info: Mapping[str, JSONValue] | None = None,
        elicitation: InputHandler | None = None,
        elicitation_modes: Sequence[str] = ("form",),
        sampling: InputHandler | None = None,
        roots: Roots | None = None,
        tasks: bool = True,
        capabilities: Mapping[str, JSONValue] | None = None,
        protocol_version: str = LATEST_VERSION,
        log_level: str | None = None,
        max_input_rounds: int = DEFAULT_MAX_ROUNDS,
        poll_interval: float = 1.0,
        listen_for_tasks: bool = True,
        on_notification: Callable[[Notification], None] | None = None,
    ) -> None:
        self.transport = transport
        self.client_info = dict(client_info or DEFAULT_CLIENT_INFO)
        self.elicitation = elicitation
        self.elicitation_modes = tuple(elicitation_modes)
        self.sampling = sampling
        self.roots = roots
        self.tasks = tasks
        self.extra_capabilities = dict(capabilities or {})
        self.protocol_version = protocol_version
        self.log_level = log_level
        self.max_input_rounds = max_input_rounds
        self.poll_interval = poll_interval
        """Seconds between ``tasks/get`` polls when the server suggests no ``pollIntervalMs``."""
        self.listen_for_tasks = listen_for_tasks
        """Follow tasks on a ``subscriptions/listen`` stream when the server grants it."""
        self.on_notification = on_notification
        self.server: ServerInfo | None = None
        self.rejected_tools: dict[str, str] = {}
        """Tools left out of ``list_tools`` (name → reason): invalid ``x-mcp-header``."""
        self._ids = itertools.count(1)
        self._tools: dict[str, Tool] = {}
        self._tools_listed = False

    # -- what every request carries ------------------------------------------------------

    @property
    def capabilities(self) -> dict[str, JSONValue]:
        """The client capabilities declared in every request's ``_meta``."""
        capabilities: dict[str, JSONValue] = {}
        if self.elicitation is not None:
            modes = [mode for mode in self.elicitation_modes if mode in ("form", "url")]
            capabilities["elicitation"] = {} if modes == ["form"] else {m: {} for m in modes}
        if self.sampling is not None:
            capabilities["sampling"] = {}
        if self.roots is not None:
            capabilities["roots"] = {}
        extensions: dict[str, JSONValue] = {}
        if self.tasks:
            extensions[TASKS_EXTENSION] = {}
        for key, value in self.extra_capabilities.items():
            if key == "extensions" and isinstance(value, dict):
                extensions.update(value)
            else:
                capabilities[key] = value
        if extensions:
            capabilities["extensions"] = extensions
        return capabilities

    def next_id(self) -> int:
        return next(self._ids)

    def message(
        self,
        method: str,
        params: Mapping[str, JSONValue] | None = None,
        *,
        capabilities: Mapping[str, JSONValue] | None = None,
        progress: bool = False,
    ) -> dict[str, JSONValue]:
        """A request with a fresh id and this client's ``_meta`` (merged into any given)."""
        request_id = self.next_id()
        body = dict(params or {})
        given = body.get("_meta")
        meta: dict[str, JSONValue] = dict(given) if isinstance(given, dict) else {}
        meta[PROTOCOL_VERSION_KEY] = self.protocol_version
        meta[CLIENT_CAPABILITIES_KEY] = dict(
            self.capabilities if capabilities is None else capabilities
        )
        meta[CLIENT_INFO_KEY] = self.client_info
        if self.log_level is not None:
            meta[LOG_LEVEL_KEY] = self.log_level
        if progress:
            meta["progressToken"] = f"progress-{request_id}"
        body["_meta"] = meta
        return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "method": method, "params": body}

    def headers(self, message: Mapping[str, JSONValue]) -> dict[str, str]:
        """The Streamable HTTP request headers that mirror ``message`` (SEP-2243)."""
        method = message["method"]
        params = message.get("params")
        assert isinstance(method, str) and isinstance(params, dict)
        headers = {"MCP-Protocol-Version": self.protocol_version, "Mcp-Method": method}
        source = NAME_SOURCES.get(method)
        value = params.get(source) if source is not None else None
        if isinstance(value, str):
            headers["Mcp-Name"] = encode_header_value(value)
        if method == "tools/call" and isinstance(value, str):
            tool = self._tools.get(value)
            arguments = params.get("arguments")
            if tool is not None and isinstance(arguments, dict):
                headers.update(param_header_pairs(tool.param_headers, arguments))
        return headers

    # -- one request ---------------------------------------------------------------------

    @asynccontextmanager
    async def open(self, message: dict[str, JSONValue]) -> AsyncIterator[Exchange]:
        """The raw exchange of ``message`` (for streams such as listen)."""
        headers = self.headers(message) if self.transport.mirrors_headers else {}
        async with self.transport.exchange(message, headers) as exchange:
            yield exchange

    async def request(
        self,
        method: str,
        params: Mapping[str, JSONValue] | None = None,
        *,
        capabilities: Mapping[str, JSONValue] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> dict[str, JSONValue]:
        """Send one request and return its result; a JSON-RPC error raises ``RpcError``.

        A ``-32022`` whose ``data.supported`` names a version this client speaks is retried
        once with that version (which the client keeps from then on).
        """
        retried = False
        while True:
            message = self.message(
                method, params, capabilities=capabilities, progress=on_progress is not None
            )
            try:
                return await self._send(message, on_progress)
            except UnsupportedVersionError as error:
                version = _best_version(error.supported)
                if retried or version is None:
                    raise
                log.info("server asked for protocol version %s; retrying", version)
                self.protocol_version = version
                retried = True

    async def _send(
        self, message: dict[str, JSONValue], on_progress: Callable[[Progress], None] | None
    ) -> dict[str, JSONValue]:
        method = message["method"]
        assert isinstance(method, str)
        async with self.open(message) as exchange:
            while True:
                frame = await exchange.receive()
                notified = frame.get("method")
                if isinstance(notified, str):
                    self._notified(notified, frame, on_progress)
                    continue
                if frame.get("id") != message["id"] and not (
                    frame.get("id") is None and "error" in frame
                ):
                    # (An error with id null is ours too: the server refused the request
                    # before reading its id, e.g. 401 or a body it could not parse.)
                    log.debug("ignoring a frame for id %r", frame.get("id"))
                    continue
                if "error" in frame:
                    raise error_from(
                        frame["error"], http_status=exchange.http_status, method=method
                    )
                result = frame.get("result")
                if not isinstance(result, dict):
                    raise ProtocolViolation(f"the result of {method} is not an object")
                return result

    def _notified(
        self,
        method: str,
        frame: Mapping[str, JSONValue],
        on_progress: Callable[[Progress], None] | None,
    ) -> None:
        params = frame.get("params")
        notification = Notification(method, params if isinstance(params, dict) else {})
        if method == "notifications/progress" and on_progress is not None:
            progress = Progress.from_params(notification.params)
            if progress is not None:
                on_progress(progress)
                return
        if self.on_notification is not None:
            self.on_notification(notification)
        else:
            log.debug("notification %s", method)

    # -- MRTR ----------------------------------------------------------------------------

    async def request_with_input(
        self,
        method: str,
        params: Mapping[str, JSONValue],
        *,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> dict[str, JSONValue]:
        """``request``, answering ``input_required`` rounds until the final result.

        Each retry is a new request (new id) with the original params, this round's answers
        and the round's ``requestState`` echoed verbatim (omitted when the server sent none).
        """
        responses: dict[str, JSONValue] | None = None
        state: JSONValue = None
        for _ in range(self.max_input_rounds + 1):
            attempt = dict(params)
            if responses is not None:
                attempt["inputResponses"] = responses
            if state is not None:
                attempt["requestState"] = state
            result = await self.request(method, attempt, on_progress=on_progress)
            if result_type(result) != "input_required":
                return result
            asked = input_requests(result.get("inputRequests"))
            state = result.get("requestState")
            if not asked and state is None:
                raise ProtocolViolation(f"{method}: input_required with neither requests nor state")
            responses = await self.answer(asked) if asked else None
        raise ProtocolViolation(f"{method}: more than {self.max_input_rounds} input rounds")

    async def answer(self, requests: Mapping[str, InputRequest]) -> dict[str, JSONValue]:
        """The application's answer to each input request, by key (one at a time, in order)."""
        responses: dict[str, JSONValue] = {}
        for key, request in requests.items():
            responses[key] = dict(await self._handler(request)(request))
        return responses

    def _handler(self, request: InputRequest) -> InputHandler:
        if request.method == "elicitation/create" and self.elicitation is not None:
            return self.elicitation
        if request.method == "sampling/createMessage" and self.sampling is not None:
            return self.sampling
        if request.method == "roots/list" and self.roots is not None:
            roots = self.roots
            if callable(roots):
                return roots
            fixed = [dict(root) for root in roots]

            async def listed(request: InputRequest) -> Mapping[str, JSONValue]:
                return {"roots": fixed}

            return listed
        raise InputNotHandled(request.key, request.method)

    # -- discovery and lists -------------------------------------------------------------

    async def discover(self) -> ServerInfo:
        """``server/discover``; settles the protocol version on one both sides speak."""
        info = ServerInfo.from_result(await self.request("server/discover"))
        if self.protocol_version not in info.supported_versions:
            version = _best_version(info.supported_versions)
            if version is None:
                raise ClientError(
                    f"the server speaks {', '.join(info.supported_versions) or 'no version'}; "
                    f"this client speaks {', '.join(SUPPORTED_VERSIONS)}"
                )
            self.protocol_version = version
        self.server = info
        return info

    async def _pages(self, method: str, key: str) -> list[dict[str, JSONValue]]:
        items: list[dict[str, JSONValue]] = []
        cursor: JSONValue = None
        seen: set[str] = set()
        while True:
            result = await self.request(method, {"cursor": cursor} if cursor is not None else {})
            page = result.get(key, [])
            if not isinstance(page, list):
                raise ProtocolViolation(f"{method}: {key} must be a list")
            items.extend(item for item in page if isinstance(item, dict))
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str) or not cursor:
                return items
            if cursor in seen:
                raise ProtocolViolation(f"{method}: the server repeated cursor {cursor!r}")
            seen.add(cursor)

    async def list_tools(self) -> list[Tool]:
        """Every tool (all pages). Over Streamable HTTP, tools whose ``x-mcp-header``
        annotations are invalid are left out, logged and listed in ``rejected_tools``."""
        tools: list[Tool] = []
        rejected: dict[str, str] = {}
        for raw in await self._pages("tools/list", "tools"):
            name = raw.get("name")
            if not isinstance(name, str) or not name:
                log.warning("ignoring a tool without a name")
                continue
            schema = raw.get("inputSchema")
            schema = schema if isinstance(schema, dict) else {}
            description = raw.get("description")
            declared: tuple[Any, ...] = ()
            if self.transport.mirrors_headers:
                try:
                    declared = declared_param_headers(schema)
                except InvalidAnnotation as error:
                    log.warning("rejecting tool %r: %s", name, error)
                    rejected[name] = str(error)
                    continue
            tools.append(
                Tool(
                    name,
                    description if isinstance(description, str) else None,
                    schema,
                    raw,
                    declared,
                )
            )
        self._tools = {tool.name: tool for tool in tools}
        self.rejected_tools = rejected
        self._tools_listed = True
        return tools

    async def list_prompts(self) -> list[dict[str, JSONValue]]:
        return await self._pages("prompts/list", "prompts")

    async def list_resources(self) -> list[dict[str, JSONValue]]:
        return await self._pages("resources/list", "resources")

    async def list_resource_templates(self) -> list[dict[str, JSONValue]]:
        return await self._pages("resources/templates/list", "resourceTemplates")

    # -- tools, prompts, resources, completion -------------------------------------------

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, JSONValue] | None = None,
        *,
        on_progress: Callable[[Progress], None] | None = None,
        on_task_state: Callable[[TaskState], None] | None = None,
    ) -> ToolResult:
        """Call a tool and return its result, following a task to its end if the server
        made one (a failed task raises its error, a cancelled one ``TaskCancelled``).

        A tool error is a result (``is_error``), not an exception.
        """
        call = await self.start_tool(name, arguments, on_progress=on_progress)
        return await call.result(on_state=on_task_state)

    async def start_tool(
        self,
        name: str,
        arguments: Mapping[str, JSONValue] | None = None,
        *,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> ToolCall:
        """Call a tool and return at once: with the result, or with a handle on its task."""
        params: dict[str, JSONValue] = {"name": name, "arguments": dict(arguments or {})}
        await self._know_tool(name)
        try:
            result = await self.request_with_input("tools/call", params, on_progress=on_progress)
        except HeaderMismatchError:
            if not self.transport.mirrors_headers:
                raise
            # The tool's x-mcp-header annotations may have changed: list again, retry once.
            log.info("tools/call %s: header mismatch; refreshing tools/list", name)
            await self.list_tools()
            self._refuse_rejected(name)
            result = await self.request_with_input("tools/call", params, on_progress=on_progress)
        if result_type(result) == "task":
            if not self.tasks:
                raise ProtocolViolation(
                    "a task was created for a request that did not declare Tasks"
                )
            return ToolCall(name, TaskHandle(self, TaskState.from_wire(result)), None)
        return ToolCall(name, None, ToolResult.from_result(result))

    def task(self, task_id: str) -> TaskHandle:
        """A handle on an existing task (created earlier, perhaps by another client)."""
        return TaskHandle(self, None, task_id=task_id)

    async def _know_tool(self, name: str) -> None:
        """Over HTTP, make sure the tool's ``Mcp-Param-*`` declarations are known."""
        if not self.transport.mirrors_headers:
            return
        self._refuse_rejected(name)
        if name in self._tools or self._tools_listed:
            return
        try:
            await self.list_tools()
        except RpcError as error:
            log.info("cannot list tools (%s); calling %s without Mcp-Param headers", error, name)
            self._tools_listed = True
        self._refuse_rejected(name)

    def _refuse_rejected(self, name: str) -> None:
        reason = self.rejected_tools.get(name)
        if reason is not None:
            raise ToolRejected(name, reason)

    async def get_prompt(
        self, name: str, arguments: Mapping[str, str] | None = None
    ) -> PromptResult:
        params: dict[str, JSONValue] = {"name": name}
        if arguments is not None:
            params["arguments"] = dict(arguments)
        return PromptResult.from_result(await self.request_with_input("prompts/get", params))

    async def read_resource(self, uri: str) -> ResourceResult:
        return ResourceResult.from_result(
            await self.request_with_input("resources/read", {"uri": uri})
        )

    async def complete(
        self,
        ref: Mapping[str, JSONValue],
        argument: str,
        value: str,
        *,
        context: Mapping[str, str] | None = None,
    ) -> Completion:
        """``completion/complete`` for ``ref`` (``{"type": "ref/prompt", "name": …}`` or
        ``{"type": "ref/resource", "uri": …}``)."""
        params: dict[str, JSONValue] = {
            "ref": dict(ref),
            "argument": {"name": argument, "value": value},
        }
        if context is not None:
            params["context"] = {"arguments": dict(context)}
        return Completion.from_result(await self.request("completion/complete", params))

    # -- subscriptions -------------------------------------------------------------------

    @asynccontextmanager
    async def listen(
        self,
        *,
        tools_list_changed: bool = False,
        prompts_list_changed: bool = False,
        resources_list_changed: bool = False,
        resource_uris: Sequence[str] = (),
        task_ids: Sequence[str] = (),
        extra: Mapping[str, JSONValue] | None = None,
    ) -> AsyncIterator[Subscription]:
        """A ``subscriptions/listen`` stream, open once the server acknowledged it.

        ``subscription.accepted`` is the filter the server granted (a subset of the request);
        iterate the subscription for notifications until the server ends it. Leaving the
        block closes the stream (on HTTP by closing it, elsewhere ``notifications/cancelled``).
        """
        wanted: dict[str, JSONValue] = {}
        if tools_list_changed:
            wanted["toolsListChanged"] = True
        if prompts_list_changed:
            wanted["promptsListChanged"] = True
        if resources_list_changed:
            wanted["resourcesListChanged"] = True
        if resource_uris:
            wanted["resourceSubscriptions"] = list(resource_uris)
        if task_ids:
            wanted["taskIds"] = list(task_ids)
        wanted.update(extra or {})
        message = self.message("subscriptions/listen", {"notifications": wanted})
        async with self.open(message) as exchange:
            subscription = Subscription(exchange, message["id"])
            await subscription.acknowledged()
            yield subscription


class Subscription:
    """An open listen stream; ``async for notification in subscription``."""

    def __init__(self, exchange: Exchange, request_id: JSONValue) -> None:
        self.exchange = exchange
        self.id = request_id
        self.accepted: dict[str, JSONValue] = {}
        self.ended = False
        """True once the server closed the stream gracefully (the listen result)."""
        self._early: deque[Notification] = deque()

    async def acknowledged(self) -> None:
        """Read until ``notifications/subscriptions/acknowledged`` (the first frame)."""
        while True:
            notification = await self._next()
            if notification is None:
                return
            if notification.method == "notifications/subscriptions/acknowledged":
                granted = notification.params.get("notifications")
                self.accepted = dict(granted) if isinstance(granted, dict) else {}
                return
            self._early.append(notification)

    @property
    def task_ids(self) -> tuple[str, ...]:
        """The ``taskIds`` the server agreed to push ``notifications/tasks`` for."""
        ids = self.accepted.get("taskIds")
        return tuple(i for i in ids if isinstance(i, str)) if isinstance(ids, list) else ()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Notification:
        if self._early:
            return self._early.popleft()
        notification = await self._next()
        if notification is None:
            raise StopAsyncIteration
        return notification

    async def _next(self) -> Notification | None:
        if self.ended:
            return None
        try:
            frame = await self.exchange.receive()
        except CancelledByServer:
            self.ended = True  # a stdio/WebSocket teardown that came without a result
            return None
        method = frame.get("method")
        if isinstance(method, str):
            params = frame.get("params")
            return Notification(method, params if isinstance(params, dict) else {})
        if "error" in frame:
            self.ended = True
            raise error_from(
                frame["error"], http_status=self.exchange.http_status, method="subscriptions/listen"
            )
        self.ended = True
        return None


def _best_version(offered: Sequence[str]) -> str | None:
    """The newest version both sides speak (dates sort as strings)."""
    common = [version for version in offered if version in SUPPORTED_VERSIONS]
    return max(common) if common else None
