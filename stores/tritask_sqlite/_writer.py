"""``WriterProcess``: the store's hot writes (creating a claimed task, a planned settle)
committed by a child process on a connection of its own, in batches.

Why a process: in one process the lane's worker thread (see :mod:`._lane`) needs the GIL for
every statement it binds and every row it steps, and on a busy server the trio thread holds
it: CPython hands a waiting thread the GIL only after a switch interval during which the holder
did not release it, and the trio thread releases it for every socket call, which restarts the
wait. The lane's thread waited for the GIL most of each batch, and the trio thread then waited
for the lane (idle 21-36% of the time in ``bench tasks``). A child process has its own GIL:
the trio thread prepares each write's statements (the records are encoded, the clock read, as
for the lane), sends a batch over a socket and goes on serving while the child runs it and
commits. One batch is in flight at a time, the next gathering meanwhile (two in flight
measured no more tasks/s in ``bench tasks`` and cost the trio thread 4-9% more CPU per task:
smaller batches, more wake-ups). The socket is driven like the PostgreSQL store's: the system
call first, ``wait_readable``/``wait_writable`` only when it would block, so a batch costs no
extra pass of trio's scheduler.

What the child does is deliberately little (:mod:`._writer_child`): it runs the statements it is
given, checks what it is told to check and commits. An item it could not write (a check that
did not hold, a failing statement, a deadline passed) comes back *undecided*, with nothing of
it written, and the store decides it on its own connection as if the writer did not exist. So
every rule the store keeps (fencing, the event-id ledger, limits, errors) stays in one place,
and the child can fail at any moment: if it dies or answers nonsense, every item it had not
answered is undecided too, the writer stops being used, and the store first looks on its own
connection for what the child committed before dying (a task row with the new claim's token, a
ledger row with the event id) before deciding anything again.

The per-caller rules are the lane's: an item is never reported before the commit that contains
it; a cancelled caller whose item is still queued withdraws it, one whose item was sent waits
(shielded) for the answer; ``committed`` callbacks run in commit order before the batch's
callers are woken.
"""

from __future__ import annotations

import collections
import logging
import marshal
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import trio

from tritask_sqlite._writer_child import HEADER, Step

__all__ = ["WriterProcess", "WriterUnavailable"]

log = logging.getLogger("tritask_sqlite")

#: Items at most in one batch.
DEFAULT_MAX_BATCH: Final = 64
#: Seconds the child may take to start and open the database.
START_TIMEOUT: Final = 30.0
#: Seconds the child may take to exit once its socket is closed, before it is killed.
EXIT_TIMEOUT: Final = 5.0
CHILD: Final = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_writer_child.py")

#: The largest answer the child sends: a flag and one byte per item of a batch.
_MAX_REPLY: Final = 1 << 16

_State = Literal["queued", "sent", "done"]


class WriterUnavailable(Exception):
    """The writer process could not be started (the store then writes on its own connection)."""


class _Item:
    __slots__ = ("committed", "payload", "state", "wake", "written")

    def __init__(
        self, payload: tuple[int | None, Sequence[Step]], committed: Callable[[], None] | None
    ) -> None:
        self.payload = payload
        self.committed = committed
        self.state: _State = "queued"
        self.written = False
        self.wake = trio.Event()


class WriterProcess:
    """The child process and the batches sent to it (one per store, owned by it)."""

    def __init__(
        self,
        path: str,
        *,
        busy_timeout_ms: int,
        synchronous: str,
        statements: Sequence[str],
        clock: Callable[[], int] | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._hello = (path, busy_timeout_ms, synchronous, list(statements))
        self._clock = clock
        self._max_batch = max_batch
        self._process: trio.Process | None = None
        self._sock: socket.socket | None = None  # non-blocking
        self._received = bytearray()
        self._queue: collections.deque[_Item] = collections.deque()
        self._pumping = False
        self._idle = trio.Event()
        self._idle.set()
        self._closing = False
        self.broken: str | None = None
        """Why the writer stopped being used (``None`` while it is)."""
        self.sqlite_version = ""
        #: Batches answered, items written by the child, items it left undecided.
        self.batches = 0
        self.written = 0
        self.undecided = 0

    @property
    def usable(self) -> bool:
        return self.broken is None and not self._closing and self._sock is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """Start the child and wait until it has opened the database."""
        parent, child = socket.socketpair()
        try:
            try:
                self._process = await trio.lowlevel.open_process(
                    [sys.executable, "-I", "-S", CHILD, str(child.fileno())],
                    pass_fds=(child.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            finally:
                child.close()
        except (OSError, ValueError) as exc:  # no such executable, no pass_fds
            parent.close()
            raise WriterUnavailable(f"cannot start the writer process: {exc}") from exc
        parent.setblocking(False)
        self._sock = parent
        try:
            with trio.fail_after(START_TIMEOUT):
                await self._send_frame(self._hello)
                reply = await self._recv_frame(1 << 20)
        except (OSError, EOFError, ValueError, trio.TooSlowError) as exc:
            await self._stop()
            raise WriterUnavailable(f"the writer process did not start: {exc!r}") from None
        except BaseException:
            await self._stop()
            raise
        if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] is True):
            await self._stop()
            detail = reply[1] if isinstance(reply, tuple) and len(reply) == 2 else reply
            raise WriterUnavailable(f"the writer process could not open the database: {detail}")
        self.sqlite_version = str(reply[1])

    async def run(
        self,
        steps: Sequence[Step],
        *,
        deadline_us: int | None = None,
        committed: Callable[[], None] | None = None,
    ) -> bool:
        """Write one item; ``True`` once the commit containing it returned, ``False`` if it
        is undecided (nothing of it was written, or the writer failed and whether it was is
        unknown: the caller looks and decides on its own connection)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.usable:
            return False
        item = _Item((deadline_us, steps), committed)
        self._queue.append(item)
        if not self._pumping:
            self._pumping = True
            self._idle = trio.Event()
            trio.lowlevel.spawn_system_task(self._pump, name="tritask_sqlite writer batch")
        try:
            await item.wake.wait()
        except BaseException as exc:
            if item.state == "queued":
                self._queue.remove(item)
                raise
            if not isinstance(exc, trio.Cancelled):
                raise  # anything but Cancelled (e.g. KeyboardInterrupt) is never swallowed
            with trio.CancelScope(shield=True):
                await item.wake.wait()
            if not item.written:
                raise  # it did not happen: the caller's Cancelled stands
        return item.written

    async def aclose(self) -> None:
        """Let the batches already taken finish, then close the socket (the child exits at its
        end of file) and wait for the child."""
        self._closing = True
        with trio.CancelScope(shield=True):
            while not self._idle.is_set():
                await self._idle.wait()
            await self._stop()

    # -- the batches: a trio system task (a batch belongs to every caller in it) ----------------

    async def _pump(self) -> None:
        try:
            while self._queue:
                batch: list[_Item] = []
                while self._queue and len(batch) < self._max_batch:
                    item = self._queue.popleft()
                    item.state = "sent"
                    batch.append(item)
                await self._exchange(batch)
        finally:
            self._pumping = False
            self._idle.set()

    async def _exchange(self, batch: list[_Item]) -> None:
        committed, decided = False, b""
        if self.broken is None:
            try:
                committed, decided = await self._round_trip([item.payload for item in batch])
            except Exception as exc:  # anything: the items fall back to the store's connection
                self._break(f"{type(exc).__name__}: {exc}")
            except BaseException:  # the run is ending: nobody may wait for this batch forever
                self._break("cancelled")
                self._decide(batch, False, b"")
                raise
            else:
                self.batches += 1
        self._decide(batch, committed, decided)

    def _decide(self, batch: list[_Item], committed: bool, decided: bytes) -> None:
        for position, item in enumerate(batch):
            item.written = committed and decided[position] == 1
            if item.written:
                self.written += 1
                if item.committed is not None:
                    item.committed()
            else:
                self.undecided += 1
        for item in batch:
            item.state = "done"
            item.wake.set()

    async def _round_trip(
        self, payloads: list[tuple[int | None, Sequence[Step]]]
    ) -> tuple[bool, bytes]:
        # An injected clock (tests) is read here, as the batch leaves; else the child reads the
        # host's in the batch's transaction.
        now = None if self._clock is None else self._clock()
        await self._send_frame((now, payloads))
        reply = await self._recv_frame(_MAX_REPLY)
        if not (
            isinstance(reply, tuple)
            and len(reply) == 2
            and isinstance(reply[0], bool)
            and isinstance(reply[1], bytes)
            and len(reply[1]) == len(payloads)
        ):
            raise ValueError(f"the writer process answered {reply!r:.200}")
        return reply

    def _break(self, why: str) -> None:
        """Stop using the child: what is queued is undecided; the socket is closed (a batch
        waiting for its answer gets an error, its items undecided too)."""
        if self.broken is not None:
            return
        self.broken = why
        log.error("the SQLite writer process failed (%s); writing on the store's connection", why)
        while self._queue:
            item = self._queue.popleft()
            self.undecided += 1
            item.state = "done"
            item.wake.set()
        self._close_socket()

    # -- the socket ------------------------------------------------------------------------------

    def _close_socket(self) -> None:
        sock = self._sock
        if sock is not None and sock.fileno() != -1:
            trio.lowlevel.notify_closing(sock)  # a task waiting on it gets ClosedResourceError
            sock.close()

    async def _send_frame(self, value: Any) -> None:
        sock = self._sock
        assert sock is not None
        payload = marshal.dumps(value)
        view = memoryview(HEADER.pack(len(payload)) + payload)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            view = view[sent:]

    async def _recv_frame(self, limit: int) -> Any:
        sock = self._sock
        assert sock is not None
        received = self._received
        while True:
            if len(received) >= HEADER.size:
                (size,) = HEADER.unpack_from(received)
                if size > limit:
                    raise ValueError(f"the writer process sent a frame of {size} bytes")
                end = HEADER.size + size
                if len(received) >= end:
                    frame = bytes(received[HEADER.size : end])
                    del received[:end]
                    return marshal.loads(frame)
            try:
                chunk = sock.recv(1 << 16)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not chunk:
                raise EOFError("the writer process closed its socket")
            received += chunk

    async def _stop(self) -> None:
        self._close_socket()
        process = self._process
        if process is None:
            return
        with trio.move_on_after(EXIT_TIMEOUT):
            await process.wait()
        if process.returncode is None:
            log.warning("the SQLite writer process did not exit in %ss; killing it", EXIT_TIMEOUT)
            process.kill()
            await process.wait()
