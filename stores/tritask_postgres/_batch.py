"""``Batcher``: concurrent store operations gathered into one transaction on one connection.

Why: every operation on its own pays its round trips, its transaction and its commit, and on
a busy server each round trip is a trio wait and wake-up in the one Python thread that also
runs HTTP. The store's two hot operations, creating a task and settling one, are each at
most two round trips of pipelined statements (lock and read or count, then write), so a batch
of them costs the same two round trips and one commit for all.

How: a caller submits an :class:`Item` and waits. When fewer than ``max_inflight`` batches
run (one by default: two side by side made smaller batches and cost more CPU per task, in
tritask and in PostgreSQL), a *runner* is started, a trio system task (no caller's cancel
scope or context variables: the batch belongs to every caller in it, so no caller's
cancellation can abort it; the statement and lock timeouts bound it). It takes up to
``max_batch`` queued items and awaits the store's ``run_batch(items)``, wakes their callers,
and takes the next batch at once, until the queue is empty. (When the head of the queue led
each batch in its own task, the next batch started only after a pass of trio's scheduler
over the callers just woken: in a loop of store calls a batch held 9 operations instead of
16.) The per-caller rules are the SQLite lane's:

* *A failing operation fails alone.* ``run_batch`` decides each item apart; an item whose
  decision raises wrote nothing. When the batch's transaction itself fails (a statement error
  aborts the whole transaction, or the connection fails before the ``COMMIT`` was sent), the
  items are marked ``alone`` and each caller runs its own operation on its own, as if there
  had been no batch, so the failure reaches only the caller it belongs to.
* *No caller hears of its commit before the commit that contains it.* Items get their
  outcome once the batch's ``COMMIT`` has returned; only then are their callers woken. If the
  connection fails after the ``COMMIT`` was sent (its outcome unknown), every item gets that
  error, as each caller would have without a batch.
* *Cancellation.* A queued item is withdrawn; an item in a running batch is waited for,
  shielded, and its caller gets the outcome (``Cancelled`` would mean it did not happen).
"""

from __future__ import annotations

import collections
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal

import attrs
import outcome
import trio

__all__ = ["Batcher", "Item"]

DEFAULT_MAX_BATCH: Final = 64
DEFAULT_MAX_INFLIGHT: Final = 1

_State = Literal["queued", "running", "done", "withdrawn"]


@attrs.define(eq=False)
class Item:
    """One operation in a batch: ``payload`` is for ``run_batch``; ``alone()`` runs the
    operation by itself (the fallback when its batch's transaction failed)."""

    payload: Any
    alone: Callable[[], Awaitable[Any]]
    state: _State = "queued"
    result: outcome.Outcome[Any] | None = None
    run_alone: bool = False
    wake: trio.Event = attrs.field(factory=trio.Event)

    def decide(self, result: outcome.Outcome[Any]) -> None:
        """The item's outcome (called by ``run_batch`` once its batch committed)."""
        self.result = result

    def fall_back(self) -> None:
        """The batch could not decide this item: its caller runs it alone."""
        self.run_alone = True


class Batcher:
    """Gathers concurrent :class:`Item` submissions into batches for ``run_batch``."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[Item]], Awaitable[None]],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        if max_batch < 1 or max_inflight < 1:
            raise ValueError("max_batch and max_inflight must be >= 1")
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._max_inflight = max_inflight
        self._queue: collections.deque[Item] = collections.deque()
        self._inflight = 0
        self.batches = 0
        self.items = 0
        self.alone = 0

    async def submit(self, item: Item) -> Any:
        """Run ``item`` in a batch; its outcome once the batch committed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._queue.append(item)
        self._start()
        try:
            await item.wake.wait()
        except BaseException:
            if item.state == "queued":
                self._queue.remove(item)
                item.state = "withdrawn"
                raise
            with trio.CancelScope(shield=True):
                await item.wake.wait()
            if item.run_alone:
                raise  # nothing happened: what interrupted the caller stands
        if item.run_alone:
            self.alone += 1
            return await item.alone()
        assert item.result is not None
        return item.result.unwrap()

    def _start(self) -> None:
        """A runner for the queue, if fewer than ``max_inflight`` run."""
        if self._queue and self._inflight < self._max_inflight:
            self._inflight += 1
            # A batch belongs to nobody in it: no caller's context variables.
            trio.lowlevel.spawn_system_task(
                self._runner, name="tritask_postgres batch runner", context=contextvars.Context()
            )

    async def _runner(self) -> None:
        """Run batches back to back while items are queued: each batch is taken (and its
        statements sent) as soon as the previous one is done, before its callers run."""
        try:
            while self._queue:
                batch: list[Item] = []
                while self._queue and len(batch) < self._max_batch:
                    taken = self._queue.popleft()
                    taken.state = "running"
                    batch.append(taken)
                await self._run(batch)
        finally:
            self._inflight -= 1
            self._start()  # an item queued as this runner stopped is not left waiting

    async def _run(self, batch: list[Item]) -> None:
        try:
            with trio.CancelScope(shield=True):
                try:
                    await self._run_batch(batch)
                except Exception:
                    # The batch failed as a whole before deciding these items: each caller
                    # runs its own operation, and meets the failure if it is its own.
                    for taken in batch:
                        if taken.result is None:
                            taken.fall_back()
        finally:
            self.batches += 1
            self.items += len(batch)
            for taken in batch:
                if taken.result is None and not taken.run_alone:
                    taken.fall_back()  # run_batch left it undecided: never leave it hanging
                taken.state = "done"
                taken.wake.set()
