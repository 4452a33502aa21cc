"""Serving initialize-era sessions (2025-06-18, 2025-11-25) with the handlers of 2026-07-28.

Era detection happens once, at the edge (the transport asks
:func:`tritask.protocol.legacy.is_legacy_request`); below it a request is either stateless
(:class:`~tritask.server.dispatcher.Dispatcher`) or carries its :class:`Session`
(:class:`LegacyDispatcher`). Both run the very same tool, prompt and resource handlers, so a
tool never knows the era:

- The request context is built from the session instead of ``_meta``: version, capabilities
  and client identity from ``initialize``, the logging threshold from ``logging/setLevel``,
  the progress token from the request's own ``_meta.progressToken``.
- An MRTR ``input_required`` answer is fulfilled here, by acting as the client would at
  2026-07-28: each input request is sent to the client as a server-initiated request
  (``elicitation/create``, ``sampling/createMessage``, ``roots/list``) on the request's own
  stream, the answers become ``inputResponses``, and the handler runs again with them and its
  ``requestState`` (which never leaves the process, so it is not sealed). The rounds are
  bounded.
- Results lose what the 2025 revisions do not have (``resultType``, caching fields, the
  ``serverInfo`` stamp), and the 2026-only error codes become their 2025 counterparts: a tool
  that needs an undeclared client capability is a tool error (``isError``), as the 2025
  scenarios ask, and an unknown resource is -32002.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import trio

from tritask.jsonrpc import (
    CustomError,
    InternalError,
    InvalidParams,
    InvalidRequest,
    JsonRpcError,
    JSONValue,
    MethodNotFound,
    Notification,
    Request,
    error_message,
    notification_message,
    result_message,
)
from tritask.protocol.auth import AccessToken
from tritask.protocol.errors import MissingRequiredClientCapability, ResourceNotFound
from tritask.protocol.legacy import (
    INITIALIZE,
    INITIALIZED,
    MODERN_ONLY_CODES,
    MODERN_ONLY_METHODS,
    PING,
    RESOURCE_NOT_FOUND,
    legacy_result,
    negotiate_version,
)
from tritask.protocol.meta import RequestMeta
from tritask.protocol.versions import CANCELLED_NOTIFICATION, INPUT_REQUIRED_METHODS
from tritask.server.context import Context, Emit
from tritask.server.results import tool_error_result
from tritask.server.session import ClientRequestFailed, Session, SessionClosed

if TYPE_CHECKING:
    from tritask.server.dispatcher import Dispatcher

log = logging.getLogger("tritask.server")

MAX_INPUT_ROUNDS: Final = 16
"""How many times one request may answer ``input_required`` before it is given up."""

Handler = Callable[[dict[str, JSONValue], Context], Awaitable[dict[str, JSONValue]]]

_LIST_FLAGS: Final = (
    ("tools", "toolsListChanged"),
    ("prompts", "promptsListChanged"),
    ("resources", "resourcesListChanged"),
)


class _TooManyRounds(JsonRpcError):
    """The request's own handler never stopped asking: the request cannot be served (a tool
    call turns it into a tool error), not a failure of the server."""

    code = -32600
    default_message = "The request kept asking for input"


def new_session_id() -> str:
    """32 URL-safe characters from ``secrets`` (visible ASCII, as the transport requires)."""
    return secrets.token_urlsafe(24)


class LegacyDispatcher:
    """Routes the requests of initialize-era sessions for one ``App``."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.app = dispatcher.app

    # -- lifecycle -----------------------------------------------------------------------

    def initialize(
        self, params: Mapping[str, JSONValue] | None, *, principal: Any = None
    ) -> tuple[Session, dict[str, JSONValue]]:
        """A new session for an ``initialize`` request, and the ``InitializeResult``."""
        params = params or {}
        requested = params.get("protocolVersion")
        if not isinstance(requested, str) or not requested:
            raise InvalidParams("initialize requires params.protocolVersion (a string)")
        capabilities = params.get("capabilities", {})
        if not isinstance(capabilities, dict):
            raise InvalidParams("initialize params.capabilities must be an object")
        client_info = params.get("clientInfo")
        if client_info is not None and not isinstance(client_info, dict):
            raise InvalidParams("initialize params.clientInfo must be an object")
        version = negotiate_version(requested)
        session = Session(
            id=new_session_id(),
            protocol_version=version,
            client_capabilities=capabilities,
            client_info=client_info,
            principal=principal,
        )
        for extension in self.app.extensions.values():
            extension.legacy_session_opened(session)
        result: dict[str, JSONValue] = {
            "protocolVersion": version,
            "capabilities": self.capabilities(session),
            "serverInfo": self.app.server_info,
        }
        if self.app.instructions:
            result["instructions"] = self.app.instructions
        return session, result

    def capabilities(self, session: Session) -> dict[str, JSONValue]:
        """The server capabilities of a legacy session, derived from the app's registries.

        Extensions see the session (its version and the client's declared capabilities), so
        what they offer may depend on what the client said it can do.
        """
        caps: dict[str, JSONValue] = {"logging": {}}
        if self.app.completions:
            caps["completions"] = {}
        if self.app.prompts:
            caps["prompts"] = {"listChanged": True}
        if self.app.has_capability("resources"):
            caps["resources"] = {"subscribe": True, "listChanged": True}
        if self.app.tools:
            caps["tools"] = {"listChanged": True}
        for extension in self.app.extensions.values():
            caps.update(extension.legacy_capabilities(session))
        return caps

    def handle_notification(self, notification: Notification, session: Session) -> None:
        """``initialized`` and ``cancelled`` matter; other client notifications are advisory."""
        if notification.method == INITIALIZED:
            session.initialized = True
        elif notification.method == CANCELLED_NOTIFICATION:
            request_id = (notification.params or {}).get("requestId")
            if session.cancel_client_request(request_id):
                log.debug("session %s cancelled request %r", session.id[:8], request_id)

    # -- requests ------------------------------------------------------------------------

    async def handle_request(
        self,
        request: Request,
        session: Session,
        *,
        transport: str = "direct",
        emit: Emit | None = None,
        close_stream: Callable[[], bool] | None = None,
        auth: AccessToken | None = None,
    ) -> dict[str, JSONValue] | None:
        """The response message, or ``None`` when the client cancelled the request.

        ``close_stream`` is the transport's way to let the request's stream go while the
        work goes on (``Context.close_stream``), where it has one. ``auth`` is this request's
        verified token (``ctx.auth``; the session's principal was fixed at ``initialize``).
        """
        try:
            result = await self._handle(request, session, transport, emit, close_stream, auth)
        except JsonRpcError as error:
            legacy_error = _legacy_error(error)
            if legacy_error.code == -32603:
                log.warning("%s (id %r) failed: %s", request.method, request.id, error.message)
            return error_message(request.id, legacy_error)
        except Exception:
            log.exception("handler for %s (id %r) raised", request.method, request.id)
            return error_message(request.id, InternalError("Internal error"))
        if result is None:
            return None
        return result_message(request.id, result)

    async def _handle(
        self,
        request: Request,
        session: Session,
        transport: str,
        emit: Emit | None,
        close_stream: Callable[[], bool] | None = None,
        auth: AccessToken | None = None,
    ) -> dict[str, JSONValue] | None:
        method = request.method
        params: dict[str, JSONValue] = dict(request.params or {})
        if method == PING:
            return {}
        if method == INITIALIZE:
            raise InvalidRequest("This session is already initialized")
        if method == "logging/setLevel":
            session.set_log_level(params.get("level"))
            return {}
        if method in ("resources/subscribe", "resources/unsubscribe"):
            return self._subscription(method, params, session)
        handler = self._route(method, session)
        if handler is None:
            raise MethodNotFound(f"Method not found: {method}")
        meta = _request_meta(params, session)
        result: dict[str, JSONValue] | None = None
        with trio.CancelScope() as scope, session.client_request(request.id, scope):
            ctx_args: dict[str, Any] = {
                "method": method,
                "meta": meta,
                "transport": transport,
                "request_id": request.id,
                "emit": emit,
                "cancel_scope": scope,
                "close_stream": close_stream,
                "auth": auth,
            }
            if method in INPUT_REQUIRED_METHODS:
                result = await self._with_inputs(handler, params, session, ctx_args)
            else:
                result = await handler(params, self._context(session, params, ctx_args))
        if result is None:
            return None
        if method == "tools/list":
            result = self._legacy_tools(result, session)
        elif method == "tools/call":
            result = legacy_call_result(result)
        return legacy_result(result)

    def _route(self, method: str, session: Session) -> Handler | None:
        if method not in MODERN_ONLY_METHODS:
            handler = self.dispatcher.core_handler(method)
            if handler is not None:
                return handler
        for extension in self.app.extensions.values():
            extension_handler = extension.legacy_methods(session).get(method)
            if extension_handler is not None:
                return extension_handler
        return None

    def _context(
        self,
        session: Session,
        params: dict[str, JSONValue],
        ctx_args: Mapping[str, Any],
        input_responses: dict[str, JSONValue] | None = None,
        request_state: JSONValue = None,
    ) -> Context:
        return Context(
            app=self.app,
            principal=session.principal,
            params=params,
            input_responses=input_responses,
            request_state=request_state,
            session=session,
            **ctx_args,
        )

    def _subscription(
        self, method: str, params: Mapping[str, JSONValue], session: Session
    ) -> dict[str, JSONValue]:
        if not self.app.has_capability("resources"):
            raise MethodNotFound(f"Method not found: {method}")
        uri = params.get("uri")
        if not isinstance(uri, str) or not uri:
            raise InvalidParams(f"{method} requires a non-empty string params.uri")
        if method == "resources/subscribe":
            session.subscribe(uri)
        else:
            session.unsubscribe(uri)
        return {}

    # -- MRTR bridged to server-initiated requests ----------------------------------------

    async def _with_inputs(
        self,
        handler: Handler,
        params: dict[str, JSONValue],
        session: Session,
        ctx_args: Mapping[str, Any],
    ) -> dict[str, JSONValue]:
        method = ctx_args["method"]
        emit: Emit | None = ctx_args["emit"]
        responses: dict[str, JSONValue] | None = None
        state: JSONValue = None
        round_params = params
        last_progress: float | None = None
        try:
            for _ in range(MAX_INPUT_ROUNDS + 1):
                ctx = self._context(session, round_params, ctx_args, responses, state)
                ctx._last_progress = last_progress
                result = await handler(round_params, ctx)
                last_progress = ctx._last_progress
                if result.get("resultType") != "input_required":
                    return result
                requests = result.get("inputRequests") or {}
                state = result.get("requestState")
                if not isinstance(requests, dict):
                    raise InternalError("input_required carried invalid inputRequests")
                if requests and emit is None:
                    raise InvalidRequest("This transport cannot carry server-initiated requests")
                responses = await self._ask(requests, session, emit)
                round_params = {**params, "inputResponses": dict(responses)}
                if state is not None:
                    round_params["requestState"] = state
            raise _TooManyRounds(
                f"The request still needed input after {MAX_INPUT_ROUNDS} rounds; giving up"
            )
        except (MissingRequiredClientCapability, ClientRequestFailed, _TooManyRounds) as error:
            if method != "tools/call":
                raise
            return tool_error_result(error.message)

    async def _ask(
        self, requests: Mapping[str, JSONValue], session: Session, emit: Emit | None
    ) -> dict[str, JSONValue]:
        """Send every input request to the client at once; their answers by key."""
        assert emit is not None
        shaped = {key: shape_input_request(request, session) for key, request in requests.items()}
        answers: dict[str, JSONValue] = {}

        async def ask(key: str, method: str, request_params: dict[str, JSONValue]) -> None:
            try:
                answers[key] = await session.request(method, request_params, emit)
            except SessionClosed:
                raise InvalidRequest("The session ended while waiting for input") from None

        if len(shaped) == 1:
            ((key, (method, request_params)),) = shaped.items()
            await ask(key, method, request_params)
            return answers
        try:
            async with trio.open_nursery() as nursery:
                for key, (method, request_params) in shaped.items():
                    nursery.start_soon(ask, key, method, request_params)
        except ExceptionGroup as group:
            # The first refusal ends the round (its siblings are cancelled): raise it alone.
            errors, _ = group.split(JsonRpcError)
            if errors is None:
                raise
            first: BaseException = errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return answers

    # -- legacy shapes -------------------------------------------------------------------

    def _legacy_tools(self, result: dict[str, JSONValue], session: Session) -> dict[str, JSONValue]:
        tools: list[JSONValue] = []
        for entry in result.get("tools") or []:
            if not isinstance(entry, dict):
                continue
            tool = dict(entry)
            output_schema = tool.get("outputSchema")
            if isinstance(output_schema, dict) and output_schema.get("type") != "object":
                # The 2025 revisions need an object schema and an object structuredContent.
                del tool["outputSchema"]
            definition = self.app.tools.get(str(tool.get("name")))
            if definition is not None:
                for extension in self.app.extensions.values():
                    tool.update(extension.legacy_tool_fields(definition, session))
            tools.append(tool)
        return {**result, "tools": tools}

    # -- the standalone stream -----------------------------------------------------------

    async def run_standalone(
        self,
        session: Session,
        emit: Emit,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Forward list changes and subscribed resource updates to ``session`` until cancelled.

        The filter shares the session's subscription list, so ``resources/subscribe`` takes
        effect at once. Ends quietly when the app's hub closes or the stream falls too far
        behind (the notifications are advisory).
        """
        accepted: dict[str, JSONValue] = {
            flag: True for capability, flag in _LIST_FLAGS if self.app.has_capability(capability)
        }
        accepted["resourceSubscriptions"] = session.resource_subscriptions
        accepted.update(session.standalone_filter)
        subscription = self.app.hub.open(accepted, live=True)
        task_status.started()
        try:
            async for event in subscription:
                await emit(notification_message(event.method, dict(event.params)))
        finally:
            self.app.hub.close_subscription(subscription)


def shape_input_request(request: JSONValue, session: Session) -> tuple[str, dict[str, JSONValue]]:
    """An MRTR input request as the server-initiated request of the session's version."""
    if not isinstance(request, dict) or not isinstance(request.get("method"), str):
        raise InternalError("An input request must be a {method, params} object")
    method: str = request["method"]
    raw_params = request.get("params")
    params: dict[str, JSONValue] = dict(raw_params) if isinstance(raw_params, dict) else {}
    if method == "elicitation/create":
        mode = params.get("mode", "form")
        if session.protocol_version == "2025-06-18":
            if mode != "form":
                raise MissingRequiredClientCapability(
                    {"elicitation": {"url": {}}}, "URL elicitation needs MCP 2025-11-25"
                )
            params.pop("mode", None)
        elif mode == "url":
            params.setdefault("elicitationId", secrets.token_urlsafe(16))
    elif method == "sampling/createMessage" and ("tools" in params or "toolChoice" in params):
        sampling = session.client_capabilities.get("sampling")
        if not (isinstance(sampling, dict) and isinstance(sampling.get("tools"), dict)):
            raise MissingRequiredClientCapability({"sampling": {"tools": {}}})
    return method, params


def _request_meta(params: Mapping[str, JSONValue], session: Session) -> RequestMeta:
    meta = params.get("_meta")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidParams("params._meta must be an object")
    token = meta.get("progressToken") if meta else None
    if token is not None and (isinstance(token, bool) or not isinstance(token, str | int)):
        raise InvalidParams("params._meta progressToken must be a string or an integer")
    return RequestMeta(
        protocol_version=session.protocol_version,
        client_capabilities=session.client_capabilities,
        client_info=session.client_info,
        progress_token=token,
        raw=dict(meta or {}),
    )


def legacy_call_result(result: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """2025 ``structuredContent`` is an object; any other JSON value stays in the text."""
    if "structuredContent" in result and not isinstance(result["structuredContent"], dict):
        return {key: value for key, value in result.items() if key != "structuredContent"}
    return result


def _legacy_error(error: JsonRpcError) -> JsonRpcError:
    """The 2025 form of an error raised by a handler written for 2026-07-28."""
    if isinstance(error, ResourceNotFound):
        return CustomError(RESOURCE_NOT_FOUND, "Resource not found", {"uri": error.uri})
    if error.code in MODERN_ONLY_CODES:
        return InvalidRequest(error.message, error.data)
    return error
