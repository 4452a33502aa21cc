"""The request ``Context`` a handler receives, and its detached form for background work.

A context is built per request from that request alone (2026-07-28 is stateless). It offers
progress and logging on the request's own stream, the caller's principal, the MRTR inputs of a
retried request, and the request's cancel scope. ``detach()`` makes the form a task worker may
keep after the request is gone: principal, negotiated capabilities and the verified token
(without the raw token) stay, and of ``_meta``
the W3C trace context (``traceparent``/``tracestate``: the work continues the request's trace);
transport, request id, progress token, the rest of ``_meta`` and request cancellation are
dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import trio

from tritask.jsonrpc import JSONValue, RequestId, notification_message
from tritask.protocol.auth import AccessToken, InsufficientScope
from tritask.protocol.capabilities import declared, elicitation_modes
from tritask.protocol.meta import LOG_LEVELS, RequestMeta
from tritask.server.mrtr import InputRequired
from tritask.server.session import Emit, Session

if TYPE_CHECKING:
    from tritask.server.app import App
    from tritask.server.listen import PushStream

HandOff = Callable[["PushStream"], bool]
"""A transport's offer to deliver a long-lived stream itself (see :meth:`Context.hand_off`)."""

log = logging.getLogger("tritask.server")

TRACE_CONTEXT_KEYS = ("traceparent", "tracestate")
"""The ``_meta`` keys of the W3C trace context (reference 1.2) a detached context keeps."""
_TRACE_KEY_SET = frozenset(TRACE_CONTEXT_KEYS)

__all__ = ["Context", "Emit", "HandOff", "InputProvider", "NotInTask", "Relay", "StepProvider"]


class NotInTask(RuntimeError):
    """``await_input`` was called outside a task (use ``InputRequired`` for plain requests)."""


class InputProvider(Protocol):
    """What a task runtime installs in a detached context so work can ask for input."""

    async def await_input(
        self, key: str, request: dict[str, JSONValue]
    ) -> dict[str, JSONValue]: ...


@runtime_checkable
class StepProvider(Protocol):
    """What a task runtime installs (with :class:`InputProvider`) for durable steps."""

    async def step(
        self,
        key: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        fingerprint: str | None = None,
        timeout_s: float | None = None,
        retry: Sequence[int] = (),
        semantics: Literal["at_least_once", "at_most_once"] = "at_least_once",
        thread: bool = False,
    ) -> Any: ...

    async def sleep(self, key: str, seconds: float) -> None: ...

    def step_key(self, key: str) -> str: ...

    @property
    def cancelled(self) -> bool: ...


class Relay(Protocol):
    """Where a detached context's progress goes while someone still waits for the work.

    A task worker's context is detached: it outlives the request and keeps nothing of it. An
    extension that makes a request wait for a task (the initialize era's task tools) hands
    the worker a relay instead: a relay forwards progress to the waiting request and turns
    inert once that request is gone, so the worker never holds a stream or a session.
    """

    async def progress(self, progress: float, total: float | None, message: str | None) -> None: ...


class Context:
    """Everything a handler may know about the request it serves."""

    def __init__(
        self,
        *,
        app: App,
        method: str,
        meta: RequestMeta,
        principal: Any = None,
        transport: str = "direct",
        request_id: RequestId | None = None,
        params: Mapping[str, JSONValue] | None = None,
        extensions: Mapping[str, JSONValue] | None = None,
        emit: Emit | None = None,
        cancel_scope: trio.CancelScope | None = None,
        input_responses: dict[str, JSONValue] | None = None,
        request_state: JSONValue = None,
        input_provider: InputProvider | None = None,
        task_id: str | None = None,
        idempotency_key: str | None = None,
        session: Session | None = None,
        close_stream: Callable[[], bool] | None = None,
        relay: Relay | None = None,
        auth: AccessToken | None = None,
        hand_off: HandOff | None = None,
    ) -> None:
        self.app = app
        self.method = method
        self.meta = meta
        self.principal = principal
        self.transport = transport
        self.request_id = request_id
        self.params: Mapping[str, JSONValue] = params or {}
        self.extensions: Mapping[str, JSONValue] = extensions or {}
        self._emit = emit
        self.cancel_scope = cancel_scope
        self.input_responses = input_responses
        self.request_state = request_state
        self._input_provider = input_provider
        self.task_id = task_id
        self.idempotency_key = idempotency_key
        self.session = session
        """The initialize-era session this request belongs to; ``None`` for 2026-07-28."""
        self._close_stream = close_stream
        self.relay = relay
        """A detached context's way to report progress to a request waiting for it."""
        self._last_progress: float | None = None
        self.auth = auth
        """The verified access token of an OAuth-protected request (``BearerAuth``), else
        ``None``: ``subject``, ``client_id``, ``scopes``, ``claims``. A detached context keeps it
        without the raw token."""
        self._hand_off = hand_off

    # -- identity and capabilities -------------------------------------------------------

    @property
    def protocol_version(self) -> str:
        return self.meta.protocol_version

    @property
    def client_capabilities(self) -> Mapping[str, JSONValue]:
        return self.meta.client_capabilities

    @property
    def client_info(self) -> Mapping[str, JSONValue] | None:
        return self.meta.client_info

    def require_scopes(self, *scopes: str) -> None:
        """Refuse the request unless its token grants ``scopes`` (under the hierarchy).

        Raises :class:`~tritask.protocol.auth.InsufficientScope`: on HTTP, before anything
        was streamed, a 403 ``insufficient_scope`` naming every scope needed (so a client can
        step up); otherwise a -32600 error. A request without a verified token (no
        ``BearerAuth``: stdio, or HTTP without OAuth) is not checked, and neither is a task
        resumed after a restart (its token is never persisted, so its ``ctx.auth`` is ``None``):
        check before the first input wait or durable sleep, or use ``required_scopes=``.
        """
        if self.auth is not None and not self.auth.has_scopes(scopes):
            raise InsufficientScope(scopes)

    def has_capability(self, name: str) -> bool:
        """Whether *this request* declared the client capability ``name``."""
        return declared(self.meta.client_capabilities, name)

    def elicitation_modes(self) -> frozenset[str]:
        return elicitation_modes(self.meta.client_capabilities)

    def negotiated(self, extension_id: str) -> bool:
        return extension_id in self.extensions

    @property
    def detached(self) -> bool:
        return self.transport == "task"

    @property
    def emit(self) -> Emit | None:
        """This request's own stream (``None`` for a detached context or a bare call).

        Server-initiated requests of a legacy session go there:
        ``await ctx.session.request(method, params, ctx.emit)``.
        """
        return self._emit

    @property
    def era(self) -> str:
        """``"legacy"`` for a request of an initialize-era session, else ``"modern"``."""
        return "modern" if self.session is None else "legacy"

    # -- request-scoped notifications ----------------------------------------------------

    async def progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Report progress on this request's stream (only when it sent a progressToken).

        A detached context with a relay reports to the request waiting for its work instead.
        """
        token = self.meta.progress_token
        if token is None or self._emit is None:
            if self.relay is not None:
                await self.relay.progress(progress, total, message)
            return
        if self._last_progress is not None and progress <= self._last_progress:
            log.debug("dropping non-increasing progress %s", progress)
            return
        self._last_progress = progress
        params: dict[str, JSONValue] = {"progressToken": token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        await self._emit(notification_message("notifications/progress", params))

    async def log(self, level: str, data: JSONValue, logger: str | None = None) -> None:
        """Send ``notifications/message`` if the client wants it at ``level``.

        A 2026-07-28 request opts in with its own ``logLevel``; a legacy session sets its
        threshold once with ``logging/setLevel`` (and gets everything until it does).
        """
        if self._emit is None or level not in LOG_LEVELS:
            return
        if self.session is not None:
            if not self.session.wants_log(level):
                return
        else:
            threshold = self.meta.log_level
            if threshold is None or LOG_LEVELS.index(level) < LOG_LEVELS.index(threshold):
                return
        params: dict[str, JSONValue] = {"level": level, "data": data}
        if logger is not None:
            params["logger"] = logger
        await self._emit(notification_message("notifications/message", params))

    async def send_notification(self, method: str, params: dict[str, JSONValue]) -> None:
        """Emit a notification on this request's own stream (listen streams use this)."""
        if self._emit is not None:
            await self._emit(notification_message(method, params))

    def close_stream(self) -> bool:
        """Let the transport close this request's response stream while the work goes on.

        This is SSE polling (2025-11-25 Streamable HTTP, SEP-1699): a long call need not hold
        a connection open; the client comes back with ``Last-Event-ID`` and gets everything
        sent meanwhile, the result included. Where closing the stream means something else
        (2026-07-28, where it is cancellation) or cannot be resumed (stdio, WebSocket,
        2025-06-18), nothing happens. ``True`` when a connection was let go.
        """
        return self._close_stream() if self._close_stream is not None else False

    def hand_off(self, stream: PushStream) -> bool:
        """Let the transport deliver ``stream`` after this handler returns (``True``), or not.

        A request that turns into a stream lasting hours (``subscriptions/listen``) should not
        keep its handler, its request and its transport's request frames alive all that time.
        A transport that can drive the stream from a task it already has (tritask's HTTP
        server: the connection's task, which also notices the client going away) takes it
        over: it sends the stream's notifications until it ends, then this request's response
        (what the handler returns), and closes it when the client goes away. ``False`` (every
        other transport, a detached context): the handler delivers it itself.
        """
        return self._hand_off is not None and self._hand_off(stream)

    # -- MRTR and task input -------------------------------------------------------------

    def input_required(
        self, requests: dict[str, dict[str, JSONValue]] | None = None, state: JSONValue = None
    ) -> InputRequired:
        return InputRequired(dict(requests or {}), state)

    def input_response(self, key: str) -> dict[str, JSONValue] | None:
        """The client's answer to input request ``key`` on this retry, if it sent one."""
        if not self.input_responses:
            return None
        value = self.input_responses.get(key)
        return value if isinstance(value, dict) else None

    async def await_input(self, key: str, request: dict[str, JSONValue]) -> dict[str, JSONValue]:
        """Park a running task until the client answers ``request`` via ``tasks/update``."""
        if self._input_provider is None:
            raise NotInTask(
                "await_input is only available inside a task; return InputRequired instead"
            )
        return await self._input_provider.await_input(key, request)

    # -- durable steps (task workers only) -----------------------------------------------

    def _steps(self, what: str) -> StepProvider:
        provider: object = self._input_provider
        if not isinstance(provider, StepProvider):
            raise NotInTask(f"{what} is only available inside a task")
        return provider

    async def step(
        self,
        key: str,
        fn: Callable[..., Any],
        *args: Any,
        fingerprint: str | None = None,
        timeout_s: float | None = None,
        retry: Sequence[int] = (),
        semantics: Literal["at_least_once", "at_most_once"] = "at_least_once",
        thread: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once for this task and key, durably.

        Its JSON result (or a :class:`~tritask.StepFailed` it raises) is committed to the task's
        store before this returns; every later attempt of the task (a retry, a recovery after a
        crash, a resumption) gets the recorded outcome for ``key`` without running ``fn``. The
        body runs at least once: a crash between its side effect and the commit runs it again,
        so give external APIs :meth:`step_key` as their idempotency key, or use
        ``semantics="at_most_once"`` (a start marker is committed first; a later attempt that
        finds it without an outcome raises :class:`~tritask.StepInterrupted`).

        ``key`` is unique for the task's life (shared with sleep and input keys); ``fingerprint``
        (default: a digest of the JSON arguments) must match on replay, else the task fails
        naming the key; ``timeout_s`` bounds each run of an async body (a thread cannot be
        interrupted: its late result is discarded with ``trio.TooSlowError``); ``retry`` is a
        list of delays (ms) for in-attempt retries of a body that raised (each runs the body
        again, ``at_most_once`` too); ``thread=True`` runs a sync ``fn`` in a worker thread,
        which may poll :attr:`cancelled`. The option names are
        reserved: pass such keyword arguments to ``fn`` with ``functools.partial``.
        """
        return await self._steps("ctx.step").step(
            key,
            fn,
            args,
            kwargs,
            fingerprint=fingerprint,
            timeout_s=timeout_s,
            retry=retry,
            semantics=semantics,
            thread=thread,
        )

    async def sleep(self, key: str, seconds: float) -> None:
        """Sleep durably: the wake instant is recorded on the store's clock, so a replay after
        a crash sleeps only what is left. A long sleep suspends the task (its worker, lease and
        slot are released, no retry is consumed) and any runner resumes it when it is due."""
        await self._steps("ctx.sleep").sleep(key, seconds)

    def step_key(self, key: str) -> str:
        """``task_id/key``: a stable idempotency key for an external call made by step ``key``."""
        return self._steps("ctx.step_key").step_key(key)

    # -- cancellation --------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """The request (or, in a task, the attempt) was cancelled; thread-safe for tasks."""
        if self.cancel_scope is not None and self.cancel_scope.cancel_called:
            return True
        provider: object = self._input_provider
        return isinstance(provider, StepProvider) and provider.cancelled

    def detach(
        self,
        *,
        input_provider: InputProvider | None = None,
        task_id: str | None = None,
        idempotency_key: str | None = None,
        relay: Relay | None = None,
    ) -> Context:
        """The worker form of this context: keep who and what, drop the request itself.

        A relay (given here, or kept from a context detached with one) is the only link to a
        request that survives, and it is inert once that request is gone.
        """
        meta = self.meta
        if (
            meta.log_level is not None
            or meta.progress_token is not None
            or not meta.raw.keys() <= _TRACE_KEY_SET
        ):
            # (A context detached already, as the runner's is when an attempt starts, keeps
            # its meta: it is exactly what this would build.)
            meta = RequestMeta(
                protocol_version=meta.protocol_version,
                client_capabilities=meta.client_capabilities,
                client_info=meta.client_info,
                raw={key: meta.raw[key] for key in TRACE_CONTEXT_KEYS if key in meta.raw},
            )
        return Context(
            app=self.app,
            method=self.method,
            meta=meta,
            principal=self.principal,
            transport="task",
            extensions=self.extensions,
            input_provider=input_provider,
            task_id=task_id,
            idempotency_key=idempotency_key,
            relay=relay if relay is not None else self.relay,
            auth=self.auth.detached() if self.auth is not None else None,
        )
