"""The table of initialize-era HTTP sessions (``Mcp-Session-Id``): bounded, expiring, owned.

2026-07-28 needs no session, so nothing here is touched by a modern request. A legacy client
gets a session at ``initialize`` and names it on every request after; the table maps the id
to an :class:`HttpSession`, which holds the transport-independent
:class:`~tritask.server.session.Session` plus what only HTTP needs: the resumable SSE streams
(:mod:`tritask.transports._sse_streams`), the requests in flight and the tasks working for it.

Three limits keep the table from growing without bound, each with an answer a client can act
on: a maximum number of sessions (a new ``initialize`` past it gets 503 with ``Retry-After``),
an idle timeout (an expired session is unknown: 404, and the client initializes again), and
the requests one session may have in flight. A session is bound to the principal that created
it; to any other caller it does not exist (the same 404, so ids cannot be probed).

Sessions live in this process: behind a load balancer, legacy clients need sticky routing.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Final

import attrs
import trio

from tritask.jsonrpc import RequestId
from tritask.server.session import Session
from tritask.transports._sse_streams import STANDALONE, EventLog, ResumableStream

log = logging.getLogger("tritask.http")

SWEEP_INTERVAL_CAP: Final = 60.0
"""The sweeper looks for idle sessions at least this often (seconds)."""


class SessionsFull(Exception):
    """The table holds ``max_sessions`` live sessions; a new one must wait."""


@attrs.define(eq=False)
class HttpSession:
    """One legacy session as the HTTP transport keeps it.

    Kept small, since an idle session is just this: the replay log, the task scopes and the
    in-flight ids are created by the first request that needs them.
    """

    session: Session
    last_seen: float
    stream_limits: tuple[int, int, int]
    """``EventLog`` budget bytes, events per stream, finished streams kept."""
    attached: int = 0
    """Connections currently writing one of this session's streams."""
    forwarding: bool = False
    """The standalone stream's notification forwarder is running."""
    ended: bool = False
    _log: EventLog | None = None
    _in_flight: set[RequestId] | None = None
    _scopes: set[trio.CancelScope] | None = None

    @property
    def id(self) -> str:
        return self.session.id

    @property
    def log(self) -> EventLog:
        if self._log is None:
            budget, per_stream, finished = self.stream_limits
            self._log = EventLog(budget, per_stream, finished)
        return self._log

    @property
    def busy(self) -> bool:
        """Something is happening: a request is running or a stream is being written."""
        return bool(self._in_flight) or self.attached > 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight) if self._in_flight else 0

    def request_running(self, request_id: RequestId) -> bool:
        return self._in_flight is not None and request_id in self._in_flight

    def start_request(self, request_id: RequestId) -> None:
        if self._in_flight is None:
            self._in_flight = set()
        self._in_flight.add(request_id)

    def end_request(self, request_id: RequestId) -> None:
        if self._in_flight is not None:
            self._in_flight.discard(request_id)

    def open_stream(self) -> ResumableStream:
        return self.log.open()

    def standalone_stream(self) -> ResumableStream | None:
        """The standalone GET stream, if one was ever opened."""
        return self._log.streams.get(STANDALONE) if self._log is not None else None

    def add_scope(self, scope: trio.CancelScope) -> None:
        """Work running for this session (cancelled when it ends)."""
        if self.ended:
            scope.cancel()
            return
        if self._scopes is None:
            self._scopes = set()
        self._scopes.add(scope)

    def remove_scope(self, scope: trio.CancelScope) -> None:
        if self._scopes is not None:
            self._scopes.discard(scope)

    def end(self) -> None:
        """Fail waiting server requests, stop the work, end every stream."""
        if self.ended:
            return
        self.ended = True
        self.session.close()
        for scope in self._scopes or ():
            scope.cancel()
        if self._log is not None:
            self._log.end()


@attrs.define(eq=False)
class SessionTable:
    """Live legacy sessions by id, least recently used first."""

    max_sessions: int
    idle_seconds: float
    stream_limits: tuple[int, int, int]
    _sessions: collections.OrderedDict[str, HttpSession] = attrs.field(
        factory=collections.OrderedDict
    )

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[HttpSession]:
        return list(self._sessions.values())

    def add(self, session: Session) -> HttpSession:
        """Admit a new session, or raise :class:`SessionsFull`."""
        if len(self._sessions) >= self.max_sessions:
            self.sweep()
            if len(self._sessions) >= self.max_sessions:
                raise SessionsFull(self.max_sessions)
        entry = HttpSession(session, trio.current_time(), self.stream_limits)
        self._sessions[session.id] = entry
        return entry

    def get(self, session_id: str, principal: Any) -> HttpSession | None:
        """The live session ``session_id`` of ``principal``, marked as used; else ``None``."""
        entry = self._sessions.get(session_id)
        if entry is None or entry.session.principal != principal:
            return None
        now = trio.current_time()
        if self._expired(entry, now):
            self.end(entry)
            return None
        entry.last_seen = now
        self._sessions.move_to_end(session_id)
        return entry

    def touch(self, entry: HttpSession) -> None:
        """The session was active just now (a stream let go of its connection)."""
        if not entry.ended:
            entry.last_seen = trio.current_time()
            self._sessions.move_to_end(entry.id)

    def end(self, entry: HttpSession) -> None:
        if self._sessions.get(entry.id) is entry:
            del self._sessions[entry.id]
        entry.end()

    def end_all(self) -> None:
        while self._sessions:
            _, entry = self._sessions.popitem(last=False)
            entry.end()

    def _expired(self, entry: HttpSession, now: float) -> bool:
        return not entry.busy and now - entry.last_seen >= self.idle_seconds

    def sweep(self) -> int:
        """End every expired session; how many ended.

        The least recently used come first, so the walk stops at the first session used
        within the timeout; a busy one met on the way counts as used now.
        """
        now = trio.current_time()
        ended = 0
        while self._sessions:
            session_id, entry = next(iter(self._sessions.items()))
            if now - entry.last_seen < self.idle_seconds:
                break
            if entry.busy:
                entry.last_seen = now
                self._sessions.move_to_end(session_id)
                continue
            del self._sessions[session_id]
            entry.end()
            ended += 1
        if ended:
            log.info("ended %d idle legacy session(s); %d remain", ended, len(self._sessions))
        return ended

    async def run_sweeper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """End idle sessions every so often, so that ones never named again are reclaimed."""
        interval = min(max(self.idle_seconds / 4, 0.001), SWEEP_INTERVAL_CAP)
        task_status.started()
        while True:
            await trio.sleep(interval)
            self.sweep()
