"""Task changes: what a store announces after each commit, so pushes reach every host.

A store that offers :class:`~tritask.tasks.store.OffersChanges` yields a :class:`TaskChange`
from ``changes()`` for every committed transition of any of its tasks and for every task it
reaps, whoever made the commit: this process (memory, SQLite, and PostgreSQL's own commits,
which carry the committed snapshot) or another host (PostgreSQL ``LISTEN/NOTIFY``, a bounded
hint of task id, revision and status; the listener reads the task through the store with its
own access). A change is a notice, never the authority: whoever renders it for a client reads
or has the store's snapshot.

:class:`ChangeFeed` is the in-process half that every built-in store uses: announcing never
blocks and never fails, and each ``changes()`` iteration has a bounded buffer. An iteration that
falls ``limit`` changes behind loses them and gets one ``resync`` instead ("anything may have
changed: re-read what you watch"), so a slow consumer never grows memory.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Final, Literal

import attrs
import trio

from tritask.tasks.model import Snapshot, Task, TaskStatus

__all__ = ["RESYNC", "ChangeFeed", "ChangeKind", "FeedReader", "TaskChange"]

ChangeKind = Literal["changed", "reaped", "resync"]

DEFAULT_FEED_LIMIT: Final = 4096


@attrs.frozen
class TaskChange:
    """One committed change of one task (or ``resync``: anything may have changed).

    ``changed``: ``revision`` and ``status`` are what the commit produced; ``task`` is the
    committed task itself (its public state, what a notification shows) when this process made
    the commit, else ``None`` (read the task through the store). ``reaped``: the task was
    deleted. ``resync``: earlier changes may be lost (a reconnect, a feed that fell behind);
    ``task_id`` is ``None``. The task is shared by every consumer: treat it as read-only.
    """

    kind: ChangeKind
    task_id: str | None
    revision: int | None = None
    status: TaskStatus | None = None
    task: Task | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def of(cls, snapshot: Snapshot, task: Task | None = None) -> TaskChange:
        """The change a committed ``snapshot`` is (``task``: an owned copy of its task)."""
        task = snapshot.task if task is None else task
        return cls("changed", task.id, snapshot.revision, task.status, task)


RESYNC: Final = TaskChange("resync", None)


@attrs.define(eq=False)
class FeedReader:
    """One reader of a :class:`ChangeFeed`: a bounded queue and a way to be woken.

    ``take()`` returns the next change or ``None``; ``waker`` (if set) is called, in the
    trio thread, whenever a change arrives, so a reader that also waits on something else
    (PostgreSQL's ``LISTEN`` socket) can wait on both without a task of its own.
    """

    limit: int
    items: collections.deque[TaskChange] = attrs.field(factory=collections.deque)
    wake: trio.Event | None = None
    waker: Callable[[], object] | None = None
    overflowed: bool = False

    def put(self, change: TaskChange) -> None:
        if self.overflowed:
            return
        if len(self.items) >= self.limit:
            self.items.clear()
            self.items.append(RESYNC)
            self.overflowed = True  # until the reader takes the resync
        else:
            self.items.append(change)
        self.notify()

    def take(self) -> TaskChange | None:
        if not self.items:
            return None
        change = self.items.popleft()
        if change is RESYNC:
            self.overflowed = False
        return change

    def notify(self) -> None:
        if self.wake is not None:
            self.wake.set()
            self.wake = None
        if self.waker is not None:
            self.waker()


class ChangeFeed:
    """A store's in-process fan-out of :class:`TaskChange` to its ``changes()`` iterations."""

    def __init__(self, *, limit: int = DEFAULT_FEED_LIMIT) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._limit = limit
        self._readers: set[FeedReader] = set()
        self._closed = False

    @property
    def active(self) -> bool:
        """Someone iterates ``changes()``: worth building a change (else skip the work)."""
        return bool(self._readers)

    @property
    def closed(self) -> bool:
        return self._closed

    def announce(self, change: TaskChange) -> None:
        for reader in self._readers:
            reader.put(change)

    def announce_snapshot(self, snapshot: Snapshot) -> None:
        if self._readers:
            self.announce(TaskChange.of(snapshot))

    def announce_reaped(self, task_ids: Iterable[str]) -> None:
        if self._readers:
            for task_id in task_ids:
                self.announce(TaskChange("reaped", task_id))

    def close(self) -> None:
        """End every iteration (after what it has buffered) and refuse new ones."""
        self._closed = True
        for reader in self._readers:
            reader.notify()

    def open_reader(self) -> FeedReader:
        """A reader that receives every change announced from now on (close it after use)."""
        reader = FeedReader(self._limit)
        if not self._closed:
            self._readers.add(reader)
        return reader

    def close_reader(self, reader: FeedReader) -> None:
        self._readers.discard(reader)

    async def changes(self, *, resync_first: bool = True) -> AsyncGenerator[TaskChange, None]:
        """Every change announced from now on; first a ``resync`` unless ``resync_first`` is
        false. Ends when the feed closes."""
        if self._closed:
            return
        reader = self.open_reader()
        try:
            if resync_first:
                yield RESYNC
            while True:
                while (change := reader.take()) is not None:
                    yield change
                if self.closed:
                    return
                reader.wake = trio.Event()
                await reader.wake.wait()
        finally:
            self.close_reader(reader)
