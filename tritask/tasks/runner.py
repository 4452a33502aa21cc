"""The Runner: executes claimed tasks in its own nursery, one cancel scope per attempt.

Each attempt runs inside its own ``trio.CancelScope``: that scope *is* the attempt's execution
token. To replace an attempt (the task was cancelled, its lease went stale, recovery reclaimed
it, it ran too long, or it expired) the runner first has the store decide, then cancels the old
scope and waits until the old attempt has really exited, and only then starts a replacement.
A late result from a replaced attempt carries an old lease generation and the store refuses it.

The store is the authority on state and time; the runner's timers only make things faster. A
runner may stop at any moment: leases expire, and any runner with ``recover=True`` picks the
work up again with ``claim_next``.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from tritask._groups import is_lone
from tritask.protocol.capabilities import require_input_request
from tritask.tasks import instrumentation as ins
from tritask.tasks.changes import TaskChange
from tritask.tasks.events import (
    MAX_STEP_OUTCOME_BYTES,
    Event,
    EventKind,
    completed_event,
    derived_event_id,
    json_size,
)
from tritask.tasks.executor import (
    Completed,
    ExecutionToken,
    Failed,
    Outcome,
    Retry,
    StaleAttempt,
    WorkExecutor,
    internal_error,
    validate_outcome,
)
from tritask.tasks.instrumentation import InstrumentationSink
from tritask.tasks.model import Snapshot, Task, TaskStatus, step_wake_at
from tritask.tasks.reducer import DuplicateInputKey, StepKeyReused, StepLimitExceeded
from tritask.tasks.steps import (
    DuplicateStepKey,
    Semantics,
    StepError,
    StepFailed,
    StepInterrupted,
    StepMismatch,
    StepMisuse,
    StepTooLarge,
    check_step_key,
    check_step_options,
    only_step_errors,
    step_fingerprint,
)
from tritask.tasks.store import (
    LEASE_LOST,
    NOT_FOUND,
    Access,
    Authority,
    CapacityExceeded,
    Claimed,
    Concurrency,
    Conflict,
    CreatesClaimed,
    Deferred,
    Lease,
    NotFound,
    OffersWakeups,
    RenewsLeases,
    RenewsOwnerLease,
    RequestAuthority,
    StaleLease,
    Store,
    Transition,
    WorkerAuthority,
    offers_changes,
    queues,
    renews_leases,
    renews_owner_lease,
    settles,
    signals_queue,
    stamps_creation,
    work_tool,
)
from tritask.tasks.work import (
    MAX_DELAY_MS,
    InvalidJSON,
    JSONObject,
    TraceContext,
    Work,
    ensure_json,
    ensure_json_object,
)

if TYPE_CHECKING:
    from tritask.server.context import Context

log = logging.getLogger("tritask.runner")

Listener = Callable[[Snapshot], None]
ChangeListener = Callable[[TaskChange], None]
Source = Literal["request", "recovery", "retry", "queue"]

EXECUTOR_FAILED = "Durable task executor failed"
NO_EXECUTOR = "Recovered work has no configured executor"
MAX_RUNTIME = "Task exceeded its maximum runtime"
SLEEP_FINGERPRINT = "sleep"
MAX_KNOWN_WAKES = 256
"""How many wake instants of suspended sleeps a recovering runner keeps (the earliest)."""

_STEP_BODY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tritask_step_body", default=None
)
"""The key of the step whose body the current trio task runs (inherited by its children), so
context calls inside a body are refused. A context variable, not shared state."""
_PARALLEL_CLAIMS = 8
"""Claims of queued work a runner keeps in flight at once while filling free slots."""


class RunnerNotRunning(RuntimeError):
    """The runner is not (or no longer) running, so it cannot take work."""


@attrs.define(eq=False)
class _Waiter:
    event: trio.Event = attrs.field(factory=trio.Event)
    response: JSONObject | None = None
    error: BaseException | None = None

    def deliver(self, response: JSONObject) -> None:
        if not self.event.is_set():
            self.response = response
            self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()


@attrs.define(eq=False)
class _LeaseGuard:
    """An attempt's lease lock: whoever uses or replaces ``job.lease`` holds it.

    A batch renewal does not take the locks of the hundreds or thousands of attempts it renews:
    it marks each free one with its ``batch`` event (one event for the whole batch) and an
    attempt that then takes its lock waits for that event before it reads ``job.lease``, which
    the batch replaces.

    A lock of its own rather than a ``trio.Lock``: nearly every attempt takes it once, to
    settle, with nobody else wanting it, and a ``trio.Lock`` per attempt (its parking lot, its
    breakers) and its schedule point on every free acquisition were about 4% of an attempt's
    CPU. Acquiring is a cancellation point as ``trio.Lock``'s is; a free lock is taken without
    yielding (what the holder does next, a store call, is the schedule point); waiters park in
    a lot made at the first contention and are handed the lock in order, as ``trio.Lock``
    hands it."""

    batch: trio.Event | None = None
    _holder: trio.lowlevel.Task | None = None
    _lot: trio.lowlevel.ParkingLot | None = None

    def locked(self) -> bool:
        return self._holder is not None

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        holder = self._holder
        if holder is None:
            self._holder = task
        elif holder is task:
            # trio.Lock's rule: waiting for a lock one holds would never end.
            raise RuntimeError("attempt to re-acquire an attempt's lease lock already held")
        else:
            lot = self._lot
            if lot is None:
                lot = self._lot = trio.lowlevel.ParkingLot()
            await lot.park()  # woken by a release, which hands the lock over to this task
        try:
            while self.batch is not None:
                await self.batch.wait()
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        lot = self._lot
        if lot:
            (self._holder,) = lot.unpark(count=1)  # the first waiter now holds it
        else:
            self._holder = None


@attrs.define(eq=False)
class _OwnerLease:
    """The runner's owner lease as the store last answered ``renew_owner``: the expiry of
    every attempt's claim that follows it (``None``: nothing follows it)."""

    expires_at: int | None = None


@attrs.define(eq=False)
class _Job:
    task_id: str
    held: Lease
    """The lease this attempt holds: its exact live claim, unless it follows ``owner``."""
    revision: int
    work: Work
    source: Source
    token: ExecutionToken
    started_at: float
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: bool = False
    """The attempt has finished (its claim released, or its release pending)."""
    ended_event: trio.Event | None = None
    """Set when it has finished; made only for a stop that waits for it (most never have one)."""
    lease_lock: _LeaseGuard = attrs.field(factory=_LeaseGuard)
    waiters: dict[str, _Waiter] = attrs.field(factory=dict)
    stop_reason: str | None = None
    settling: bool = False
    outcome: str = "stopped"
    store_outcome: str = "not_settled"
    retry_delay_ms: int | None = None
    terminal: bool = False
    released: bool = False
    helpers: set[trio.CancelScope] | None = None
    """Cancel scopes of the attempt's running heartbeat / runtime-limit tasks (if any)."""
    helpers_idle: trio.Event | None = None
    claim_duration: float | None = None
    """How long the claim that started this attempt took (``None``: made by the creation)."""
    steps: dict[str, JSONObject] = attrs.field(factory=dict)
    """The task's recorded steps as this attempt knows them (only its lease may add any)."""
    step_keys: set[str] = attrs.field(factory=set)
    """The step and sleep keys this attempt used (a second use raises)."""
    input_keys: set[str] = attrs.field(factory=set)
    """The task's input keys as this attempt knows them (a step or sleep may not reuse one)."""
    wake_delay_ms: int | None = None
    """Set when the attempt ended by a durable sleep's suspension: how long until it is due."""
    owner: _OwnerLease | None = None
    """The runner's owner lease while this attempt's claim follows it (``renew_owner``)."""

    @property
    def lease(self) -> Lease:
        """The exact live claim as this attempt knows it: ``held``, or, while the claim follows
        the runner's owner lease, ``held`` at the owner lease's expiry. Built when read (by a
        write, under the lease lock), so a heartbeat makes no object per attempt."""
        owner = self.owner
        if owner is None:
            return self.held
        expires_at = owner.expires_at
        assert expires_at is not None
        return attrs.evolve(self.held, expires_at=expires_at)

    @lease.setter
    def lease(self, value: Lease) -> None:
        """An exact lease of the attempt's own (a claim, a renewal alone)."""
        self.held = value
        self.owner = None


@attrs.define(eq=False)
class _AttemptInput:
    """The input channel of one attempt: refuses to act once the attempt is replaced."""

    runner: Runner
    job: _Job

    async def await_input(self, key: str, request: JSONObject) -> JSONObject:
        return await self.runner._await_input(self.job, key, request)

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
        semantics: Semantics = "at_least_once",
        thread: bool = False,
    ) -> Any:
        return await self.runner._step(
            self.job,
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
        await self.runner._sleep(self.job, key, seconds)

    def step_key(self, key: str) -> str:
        return f"{self.job.task_id}/{check_step_key(key)}"

    @property
    def cancelled(self) -> bool:
        return self.job.token.cancelled


@attrs.frozen
class RunnerStatistics:
    jobs: int
    peak_jobs: int
    started: int
    stopped: int
    awaiting_slot: int
    scheduled_retries: int
    queued: int = 0
    """Tasks this runner stored queued (no slot was free) and has not seen start since."""


def _positive(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer")


class Runner:
    """Supervises task attempts; start it with ``await nursery.start(runner.run)``."""

    def __init__(
        self,
        store: Store,
        *,
        executor: WorkExecutor | None = None,
        executor_state: Any = None,
        recover: bool = False,
        owner_id: str | None = None,
        lease_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        recovery_interval_ms: int = 1_000,
        recovery_batch_size: int = 100,
        reap_interval_ms: int | None = 60_000,
        max_jobs: int = 32,
        max_runtime_ms: int | None = 3_600_000,
        instrumentation: InstrumentationSink | None = None,
        settle_attempts: int = 5,
        release_retry_ms: int = 100,
        suspend_sleep_after_ms: int | None = 5_000,
        suspend_input_after_ms: int | None = None,
        max_queued_contexts: int = 1024,
    ) -> None:
        _positive("lease_ms", lease_ms)
        heartbeat = heartbeat_ms if heartbeat_ms is not None else max(lease_ms // 3, 1)
        _positive("heartbeat_ms", heartbeat)
        if heartbeat >= lease_ms:
            raise ValueError("heartbeat_ms must be smaller than lease_ms")
        _positive("recovery_interval_ms", recovery_interval_ms)
        _positive("recovery_batch_size", recovery_batch_size)
        _positive("reap_interval_ms", reap_interval_ms, allow_none=True)
        _positive("max_jobs", max_jobs)
        _positive("max_runtime_ms", max_runtime_ms, allow_none=True)
        _positive("settle_attempts", settle_attempts)
        _positive("release_retry_ms", release_retry_ms)
        _positive("suspend_sleep_after_ms", suspend_sleep_after_ms, allow_none=True)
        _positive("suspend_input_after_ms", suspend_input_after_ms, allow_none=True)
        if not isinstance(max_queued_contexts, int) or max_queued_contexts < 0:
            raise ValueError("max_queued_contexts must be an int >= 0")
        if owner_id is not None and (not isinstance(owner_id, str) or not owner_id):
            raise ValueError("owner_id must be a non-empty string")
        self.store = store
        self.executor = executor
        self.executor_state = executor_state
        self.recover = recover
        self.owner_id = owner_id or secrets.token_urlsafe(18)
        self.lease_ms = lease_ms
        self.heartbeat_ms = heartbeat
        self.recovery_interval_ms = recovery_interval_ms
        self.recovery_batch_size = recovery_batch_size
        self.reap_interval_ms = reap_interval_ms
        self.max_jobs = max_jobs
        self.max_runtime_ms = max_runtime_ms
        self.instrumentation = instrumentation
        self.settle_attempts = settle_attempts
        self.release_retry_ms = release_retry_ms
        self.suspend_sleep_after_ms = suspend_sleep_after_ms
        """A durable sleep with longer than this left suspends the task (``None``: never)."""
        self.suspend_input_after_ms = suspend_input_after_ms
        """An input wait longer than this suspends the task (``None``: never)."""
        self._wakes: list[float] = []
        """The earliest wakes (trio clock, sorted, at most :data:`MAX_KNOWN_WAKES`) of sleeps
        this runner suspended: its recovery pass runs at each; polling covers the rest."""
        self.max_queued_contexts = max_queued_contexts
        self._jobs: dict[str, _Job] = {}
        self._contexts: dict[str, Context] = {}
        # Queued and suspended tasks hold no trio task and no runner memory, except the
        # request contexts of at most max_queued_contexts of them together (the first queued:
        # FIFO starts them first; the first suspended). Beyond that a task resumes with a
        # context rebuilt from its work, as it would on another host.
        self._queued_contexts: set[str] = set()
        self._parked_contexts: set[str] = set()
        self._queued_here = 0
        # Whether the store may hold claimable work this runner has not asked for yet: set by
        # a task queued here, a store signal or wake-up, a claim_next that found work; cleared
        # by a claim_next that found none. A freed slot asks the store only then, so a runner
        # without a backlog spends no store call per attempt. A creation with a free slot
        # under this belief asks the store first (``_older_first``): the belief is corrected
        # there, never left to queue every creation behind work that does not exist.
        self._backlog = False
        # Counts the events that set the belief: a claim_next that found nothing clears it
        # only if none came after that call was made (its answer may be older than they).
        self._backlog_events = 0
        self._claiming = 0
        self._filling = False
        self._fill_again = False
        self._retry_scopes: dict[str, trio.CancelScope] = {}
        self._awaiting_slot: deque[str] = deque()
        self._listeners: list[Listener] = []
        self._watchers: list[ChangeListener] = []
        # Whether watchers hear the store's own feed (every writer, every host) rather than
        # this runner's transitions: decided when the runner starts.
        self._store_changes = offers_changes(store)
        self._nursery: trio.Nursery | None = None
        self._stopping = trio.Event()
        self._recover_soon = trio.Event()
        self._stopped = trio.Event()
        self._peak = 0
        self._started_count = 0
        self._stopped_count = 0
        self._cm_nursery: Any = None
        # Due times (trio clock) of each attempt's next heartbeat and of its runtime limit.
        # Every attempt waits the same interval, so insertion order is due order: the first
        # item is always the earliest. One timer task serves them all (see _timer_loop); on a
        # store that renews leases in batches the heartbeats are the renewal loop's instead
        # (see _renewal_loop).
        self._heartbeat_due: dict[_Job, float] = {}
        self._runtime_due: dict[_Job, float] = {}
        self._timer_added = trio.Event()
        self._renewal_added = trio.Event()
        self._batch_renewal = False
        # renew_owner: the owner lease, and the attempts of the last batch (those whose claim
        # may follow it).
        self._owner_lease = _OwnerLease()
        self._following: list[_Job] = []

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._nursery is not None and not self._stopping.is_set()

    async def run(self, *, task_status: trio.TaskStatus[Runner] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`stop`; then stop every attempt and release every lease."""
        if self._nursery is not None or self._stopped.is_set():
            raise RuntimeError("a Runner can run only once")
        unlisten: Callable[[], None] | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._store_changes:
                    # Registered with the store's feed before anything can commit.
                    await nursery.start(self._changes_loop)
                if signals_queue(self.store):
                    unlisten = self.store.listen_queue(self._queue_signal)
                if self.recover:
                    nursery.start_soon(self._recovery_loop)
                if isinstance(self.store, OffersWakeups):
                    nursery.start_soon(self._wakeup_loop, self.store)
                if self.reap_interval_ms is not None:
                    nursery.start_soon(self._reap_loop)
                store = self.store
                if renews_owner_lease(store):
                    self._batch_renewal = True
                    nursery.start_soon(
                        self._renewal_loop, functools.partial(self._renew_owner_batch, store)
                    )
                elif renews_leases(store):
                    self._batch_renewal = True
                    nursery.start_soon(
                        self._renewal_loop, functools.partial(self._renew_batch, store)
                    )
                nursery.start_soon(self._timer_loop)
                task_status.started(self)
                await self._stopping.wait()
                with trio.CancelScope(shield=True):
                    await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            if unlisten is not None:
                unlisten()
            self._stopping.set()
            self._stopped.set()

    def stop(self) -> None:
        """Ask the runner to stop; ``run`` returns once every attempt has exited."""
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Runner:
        self._cm_nursery = trio.open_nursery()
        nursery = await self._cm_nursery.__aenter__()
        try:
            await nursery.start(self.run)
        except BaseException as exc:
            await self._cm_nursery.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self.stop()
        try:
            result: bool | None = await self._cm_nursery.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            if is_lone(group, exc):
                return False  # the caller's own exception propagates as it was raised
            raise
        return result

    async def _drain(self) -> None:
        for scope in list(self._retry_scopes.values()):
            scope.cancel()
        self._awaiting_slot.clear()
        async with trio.open_nursery() as nursery:
            for job in list(self._jobs.values()):
                nursery.start_soon(self._stop_job, job, "runner_stopped")

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(
            jobs=len(self._jobs),
            peak_jobs=self._peak,
            started=self._started_count,
            stopped=self._stopped_count,
            awaiting_slot=len(self._awaiting_slot),
            scheduled_retries=len(self._retry_scopes),
            queued=self._queued_here,
        )

    def active_task_ids(self) -> list[str]:
        return sorted(self._jobs)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(snapshot)`` after every transition this runner applies."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def watch(self, listener: ChangeListener) -> Callable[[], None]:
        """Call ``listener(change)`` for every committed change of the store's tasks.

        With a store that offers ``changes()`` (:class:`~tritask.tasks.store.OffersChanges`)
        these are the store's own: every writer's, on every host, and ``resync`` whenever some
        may have been lost. Otherwise they are the transitions this runner applies and the
        tasks it reaps. Listeners run synchronously in the runner and must not block.
        """
        self._watchers.append(listener)
        return lambda: self._watchers.remove(listener) if listener in self._watchers else None

    def set_default_executor(self, executor: WorkExecutor, state: Any = None) -> None:
        """Install an executor unless the application configured one (used by extensions)."""
        if self.executor is None:
            self.executor = executor
            self.executor_state = state

    def _require_running(self) -> trio.Nursery:
        if self._nursery is None or self._stopping.is_set():
            raise RunnerNotRunning("the task runner is not running")
        return self._nursery

    # -- store calls with instrumentation ------------------------------------------------

    def _emit(self, name: str, measurements: dict[str, float | int], meta: dict[str, Any]) -> None:
        ins.emit(self.instrumentation, name, measurements, meta)

    def _publish(self, snapshot: Snapshot) -> None:
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:
                log.exception("task listener failed")
        if self._watchers and not self._store_changes:
            self._announce(TaskChange.of(snapshot))

    def _park_context(self, task_id: str) -> None:
        """Keep a suspended task's request context for its resumption here, within the bound."""
        if task_id not in self._contexts or task_id in self._queued_contexts:
            return
        if len(self._queued_contexts) + len(self._parked_contexts) < self.max_queued_contexts:
            self._parked_contexts.add(task_id)
        else:
            del self._contexts[task_id]

    def _forget_context(self, task_id: str) -> None:
        self._contexts.pop(task_id, None)
        self._queued_contexts.discard(task_id)
        self._parked_contexts.discard(task_id)

    def _announce(self, change: TaskChange) -> None:
        # A task that ended or was reaped elsewhere (another runner, another host) needs no
        # context kept here any more.
        task_id = change.task_id
        if (
            task_id is not None
            and task_id in self._contexts
            and task_id not in self._jobs
            and (
                change.kind == "reaped" or (change.status is not None and change.status.is_terminal)
            )
        ):
            self._forget_context(task_id)
        for listener in list(self._watchers):
            try:
                listener(change)
            except Exception:
                log.exception("task change listener failed")

    async def _transition(
        self,
        task_id: str,
        revision: int,
        event: Event,
        authority: Authority,
        *,
        settle: bool = False,
    ) -> Transition | Conflict | NotFound:
        """``store.transition``; with ``settle`` (a worker's final event on a store that
        offers it) ``store.settle``, which also releases the claim when it answers a
        ``Transition``."""
        started = trio.current_time()
        outcome = "error"
        try:
            if settle and settles(self.store) and isinstance(authority, WorkerAuthority):
                result = await self.store.settle(task_id, revision, event, authority.lease)
            else:
                result = await self.store.transition(task_id, revision, event, authority)
            if isinstance(result, Transition):
                outcome = result.outcome
                if result.outcome == "applied":
                    self._publish(result.snapshot)
            elif isinstance(result, Conflict):
                outcome = "conflict"
            else:
                outcome = "not_found"
            return result
        finally:
            self._emit(
                ins.STORE_TRANSITION,
                {"duration": trio.current_time() - started},
                {
                    "task_id": task_id,
                    "expected_revision": revision,
                    "event_kind": event.kind.value,
                    "authority": "worker" if isinstance(authority, WorkerAuthority) else "request",
                    "outcome": outcome,
                    "settle": settle,
                },
            )

    async def _commit_worker(
        self, job: _Job, event: Event, *, settle: bool = False
    ) -> Transition | None:
        """Apply a worker event by compare-and-set, following conflicts with fresh revisions.

        A store failure (a busy database, a lost connection) is retried with the same event:
        its id makes the resend idempotent, so a commit whose acknowledgement was lost comes
        back as ``duplicate``. After ``settle_attempts`` the attempt gives up (``None``); the
        claim then lapses and recovery runs the work again. With ``settle`` and a store that
        offers it, the final event also releases the claim in the same step (``job.released``).
        """
        settle = settle and settles(self.store)
        revision = job.revision
        for _ in range(self.settle_attempts):
            try:
                async with job.lease_lock:
                    result = await self._transition(
                        job.task_id, revision, event, WorkerAuthority(job.lease), settle=settle
                    )
                    if settle and isinstance(result, Transition):
                        job.released = True
            except StaleLease:
                self._emit(
                    ins.FENCED_WRITE_REJECTED,
                    {"generation": job.lease.generation},
                    {"task_id": job.task_id, "event_kind": event.kind.value},
                )
                return None
            except (DuplicateInputKey, StepKeyReused, StepLimitExceeded):
                raise  # the reducer's verdict, not a store failure
            except Exception:
                log.exception("committing %s for task %s failed; retrying", event.kind, job.task_id)
                await trio.sleep(self.release_retry_ms / 1000)
                continue
            if isinstance(result, Transition):
                job.revision = max(job.revision, result.snapshot.revision)
                return result
            if isinstance(result, Conflict):
                revision = result.snapshot.revision
                job.revision = revision
                continue
            return None
        log.error("gave up committing %s for task %s after conflicts", event.kind, job.task_id)
        return None

    async def _request_transition(
        self, task_id: str, event: Event, access: Access
    ) -> Transition | NotFound:
        snapshot = await self.store.get(task_id, access)
        if isinstance(snapshot, NotFound):
            return NOT_FOUND
        for _ in range(self.settle_attempts):
            result = await self._transition(
                task_id, snapshot.revision, event, RequestAuthority(access)
            )
            if isinstance(result, Conflict):
                snapshot = result.snapshot
                continue
            return result
        raise RuntimeError(f"transition of task {task_id} kept conflicting")

    # -- request operations --------------------------------------------------------------

    async def create_task(
        self,
        task: Task,
        work: Work,
        access: Access,
        *,
        context: Context | None = None,
        stamp: bool = False,
        concurrency: Concurrency | None = None,
    ) -> Snapshot:
        """Store the task, and start it here when a slot is free; else it waits queued.

        A slot is taken when one of ``max_jobs`` is free and no task this runner queued is
        still waiting (first in first out); the task is then created already claimed, so no
        recovering runner can adopt it first (``submit``, ``create_claimed_stamped`` or
        ``create_claimed`` when the store offers them, else ``create`` then ``claim``).
        Otherwise, or when its ``concurrency`` key is full, it is stored unclaimed, queued,
        and the first runner of the store with a free slot claims it (this one when a slot
        frees here, any other one through ``claim_next``). With ``stamp`` the task's
        ``createdAt``/``lastUpdatedAt`` (placeholders) become the store's clock at creation.
        ``concurrency`` needs a store that offers :class:`~tritask.tasks.store.Queues` and
        ``stamp``.
        """
        self._require_running()
        if concurrency is not None and not (stamp and queues(self.store)):
            raise TypeError(
                "concurrency keys need stamp=True and a store that offers Queues (submit)"
            )
        trace = work.trace_context
        if trace is None and context is not None:
            trace = TraceContext.from_carrier(context.meta.raw)
        tool = work_tool(work)
        started = trio.current_time()
        outcome = "error"
        with ins.creating_scope(
            self.instrumentation,
            task_id=task.id,
            tool=tool,
            work_type=work.type,
            trace_context=trace,
        ) as persisted:
            try:
                if persisted is not None and persisted != work.trace_context:
                    work = attrs.evolve(work, trace_context=persisted)
                snapshot, queued = await self._create(
                    task, work, access, context, stamp, concurrency
                )
                outcome = "queued" if queued else "created"
                return snapshot
            finally:
                self._emit(
                    ins.TASK_CREATED,
                    {"duration": trio.current_time() - started},
                    {"task_id": task.id, "tool": tool, "outcome": outcome},
                )

    def _free_slots(self) -> int:
        return self.max_jobs - len(self._jobs) - self._claiming

    async def _create(
        self,
        task: Task,
        work: Work,
        access: Access,
        context: Context | None,
        stamp: bool,
        concurrency: Concurrency | None,
    ) -> tuple[Snapshot, bool]:
        """The stored task, and whether it waits queued."""
        take = self._free_slots() > 0 and not self._awaiting_slot
        if take and self._backlog:
            take = await self._older_first()
        if stamp and queues(self.store):
            return await self._submit(task, work, access, context, take, concurrency)
        if not take:
            if stamp:
                now = await self.store.now()
                task = attrs.evolve(task, created_at=now, last_updated_at=now)
            snapshot = await self.store.create(task, work, access)
            self._queued(task.id, context)
            return snapshot, True
        if context is not None:
            self._contexts[task.id] = context
        started = trio.current_time()
        self._claiming += 1
        try:
            if stamp and stamps_creation(self.store):
                claimed = await self.store.create_claimed_stamped(
                    task, work, access, self.owner_id, self.lease_ms
                )
                await self._start(claimed, "request", trio.current_time() - started)
                return claimed.snapshot, False
            if stamp:
                now = await self.store.now()
                task = attrs.evolve(task, created_at=now, last_updated_at=now)
            if isinstance(self.store, CreatesClaimed):
                claimed = await self.store.create_claimed(
                    task, work, access, self.owner_id, self.lease_ms
                )
                await self._start(claimed, "request", trio.current_time() - started)
                return claimed.snapshot, False
            snapshot = await self.store.create(task, work, access)
        except BaseException:
            self._contexts.pop(task.id, None)
            raise
        finally:
            self._claiming -= 1
        await self._claim_and_start(task.id, "request")
        return snapshot, False

    async def _older_first(self) -> bool:
        """Before a creation with a free slot, while this runner believes the store may hold
        claimable work: ask the store (``claim_next``) and take that older work first, first
        in first out; return whether a slot is still free for the new task. A ``claim_next``
        that finds nothing corrects the belief (see ``_backlog``), so the new task and those
        after it are created already claimed (two writes per task, not three: create, claim,
        settle) instead of being stored queued and drained. Claims one at a time while it
        finds work and a slot is free; one call that finds nothing when there is none; a
        store failure leaves the belief and queues the task."""
        try:
            await self._claim_queued(self._free_slots())
        except Exception:
            log.exception("claiming queued work before a creation failed; queueing it")
            return False
        return self._free_slots() > 0 and not self._backlog and not self._awaiting_slot

    async def _submit(
        self,
        task: Task,
        work: Work,
        access: Access,
        context: Context | None,
        take: bool,
        concurrency: Concurrency | None,
    ) -> tuple[Snapshot, bool]:
        """Create through ``Queues.submit``: claimed for this runner when ``take`` and the
        task's key allow, else queued."""
        assert queues(self.store)
        started = trio.current_time()
        if take:
            self._claiming += 1
        try:
            result = await self.store.submit(
                task,
                work,
                access,
                owner_id=self.owner_id if take else None,
                lease_ms=self.lease_ms,
                concurrency=concurrency,
            )
            if isinstance(result, Claimed):
                if context is not None:
                    self._contexts[task.id] = context
                await self._start(result, "request", trio.current_time() - started)
                return result.snapshot, False
        finally:
            if take:
                self._claiming -= 1
        self._queued(task.id, context)
        return result, True

    def _queued(self, task_id: str, context: Context | None) -> None:
        """A task this runner stored queued: keep its context (within the bound) for when a
        slot frees here, and claim at once if a slot is free (its key was full, say)."""
        self._queued_here += 1
        self._backlog = True
        self._backlog_events += 1
        kept = len(self._queued_contexts) + len(self._parked_contexts)
        if context is not None and kept < self.max_queued_contexts:
            self._contexts[task_id] = context
            self._queued_contexts.add(task_id)
        if self._free_slots() > 0:
            self._drain_soon()

    async def start_task(self, task_id: str, *, context: Context | None = None) -> None:
        """Claim and start an existing task here (a no-op if this runner already runs it)."""
        self._require_running()
        if context is not None:
            self._contexts[task_id] = context
        if task_id in self._jobs:
            return
        if self._free_slots() <= 0:
            raise _JobCapacity()
        await self._claim_and_start(task_id, "request")

    async def cancel(self, task_id: str, access: Access) -> Snapshot | NotFound:
        """Commit ``cancelled`` first, then stop the local attempt and wait for it to exit."""
        result = await self._request_transition(task_id, Event.cancelled(), access)
        if isinstance(result, NotFound):
            return NOT_FOUND
        if result.snapshot.task.status == TaskStatus.CANCELLED:
            await self._abandon(task_id, "cancelled")
        return result.snapshot

    async def update(
        self, task_id: str, responses: JSONObject, access: Access
    ) -> Snapshot | NotFound:
        """Accept input responses in the store, then wake the attempts waiting for them."""
        result = await self._request_transition(
            task_id, Event.input_responses_accepted(responses), access
        )
        if isinstance(result, NotFound):
            return NOT_FOUND
        accepted = result.effects.accepted_input_responses or {}
        job = self._jobs.get(task_id)
        if job is None and accepted and result.snapshot.available_at is None:
            self._resume_soon(task_id)
        if job is not None:
            # The attempt's next commit expects this revision (saves a conflict round trip).
            job.revision = max(job.revision, result.snapshot.revision)
            for key, response in accepted.items():
                waiter = job.waiters.get(key)
                if waiter is not None:
                    waiter.deliver(response)
        return result.snapshot

    def _resume_soon(self, task_id: str) -> None:
        """Try to claim a task whose input was just answered here: it may have been suspended
        for it (a task running elsewhere is simply unavailable). With every slot taken it waits
        for a free one, as a due retry does."""
        if self.running:
            self._schedule_retry(task_id, 0)

    async def _abandon(self, task_id: str, reason: str) -> None:
        scope = self._retry_scopes.pop(task_id, None)
        if scope is not None:
            scope.cancel()
        with contextlib.suppress(ValueError):
            self._awaiting_slot.remove(task_id)
        self._forget_context(task_id)
        job = self._jobs.get(task_id)
        if job is not None:
            await self._stop_job(job, reason)

    # -- claiming and starting -----------------------------------------------------------

    async def _claim_and_start(self, task_id: str, source: Source) -> None:
        nursery = self._nursery
        if nursery is None or self._stopping.is_set():
            return
        started = trio.current_time()
        result = await self.store.claim(task_id, self.owner_id, self.lease_ms)
        if isinstance(result, Claimed):
            await self._start(result, source, trio.current_time() - started)
        elif isinstance(result, Deferred) and result.remaining_ms <= MAX_DELAY_MS:
            # (longer: suspended until its input is answered, which makes it claimable)
            self._schedule_retry(task_id, result.remaining_ms)

    async def _start(self, claimed: Claimed, source: Source, duration: float) -> None:
        """Start an attempt on a claim that took ``duration`` seconds to make."""
        snapshot, lease = claimed.snapshot, claimed.lease
        self._emit(
            ins.LEASE_CLAIMED,
            {"generation": lease.generation, "duration": duration},
            {"task_id": lease.task_id, "source": source},
        )
        nursery = self._nursery
        if nursery is None or self._stopping.is_set() or snapshot.work is None:
            await self._release(lease)
            return
        old = self._jobs.get(lease.task_id)
        if old is not None:
            self._emit(
                ins.RECOVERY_RECLAIMED,
                {"generation": lease.generation},
                {"task_id": lease.task_id},
            )
            await self._stop_job(old, "reclaimed")
            # The old attempt may take longer to exit than the new claim lives (it can shield
            # itself from cancellation): never start work on a claim that has lapsed meanwhile.
            try:
                lease = await self.store.renew(lease, self.lease_ms)
            except StaleLease:
                self._emit(
                    ins.LEASE_LOST, {"generation": lease.generation}, {"task_id": lease.task_id}
                )
                return
            except Exception:
                log.exception("renewing the reclaimed lease of task %s failed", lease.task_id)
        self._parked_contexts.discard(lease.task_id)
        if lease.task_id in self._queued_contexts:
            self._queued_contexts.discard(lease.task_id)
            source = "queue"  # queued here, and its request context kept
        token = ExecutionToken(
            task_id=lease.task_id,
            idempotency_key=snapshot.work.idempotency_key,
            generation=lease.generation,
            recovered=source == "recovery",
            context=None,
        )
        job = _Job(
            task_id=lease.task_id,
            held=lease,
            revision=snapshot.revision,
            work=snapshot.work,
            source=source,
            token=token,
            started_at=trio.current_time(),
            claim_duration=None if source == "request" else duration,
            steps=snapshot.steps,
            input_keys=set(snapshot.task.used_input_keys),
        )
        token._input = _AttemptInput(self, job)
        context = self._contexts.get(lease.task_id)
        if context is not None:
            token.context = context.detach(
                input_provider=token._input,
                task_id=lease.task_id,
                idempotency_key=snapshot.work.idempotency_key,
            )
        # Registered before the attempt's task first runs: a stop requested meanwhile cancels
        # job.scope before it is entered, and the attempt then exits at once through _finish.
        self._jobs[job.task_id] = job
        self._started_count += 1
        self._peak = max(self._peak, len(self._jobs))
        self._emit(
            ins.JOB_START,
            {"jobs": len(self._jobs), "system_time": trio.current_time()},
            {
                "task_id": job.task_id,
                "revision": job.revision,
                "source": job.source,
                "tool": work_tool(job.work),
            },
        )
        sink = self.instrumentation
        if sink is not None and ins.traces_tasks(sink):
            nursery.start_soon(self._job_main, job)
        else:  # no attempt scope to open: one coroutine less on every resumption of the attempt
            nursery.start_soon(self._attempt, job)

    def _schedule_retry(self, task_id: str, delay_ms: int) -> None:
        nursery = self._nursery
        if nursery is None or self._stopping.is_set() or task_id in self._retry_scopes:
            return
        scope = trio.CancelScope()
        self._retry_scopes[task_id] = scope
        nursery.start_soon(self._retry_due, task_id, delay_ms, scope)

    async def _retry_due(self, task_id: str, delay_ms: int, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(delay_ms / 1000)
        if self._retry_scopes.get(task_id) is scope:
            del self._retry_scopes[task_id]
        if scope.cancelled_caught or task_id in self._jobs:
            return
        if self._free_slots() <= 0:
            if task_id not in self._awaiting_slot:
                self._awaiting_slot.append(task_id)
            return
        await self._claim_retry(task_id)

    async def _claim_retry(self, task_id: str) -> None:
        """Claim a due retry; a store failure tries again later instead of stopping the runner."""
        try:
            await self._claim_and_start(task_id, "retry")
        except Exception:
            log.exception("claiming the retry of task %s failed; trying again", task_id)
            self._schedule_retry(task_id, self.release_retry_ms)

    def _may_drain(self) -> bool:
        """Whether a freed slot should ask the store for queued work (see ``_backlog``)."""
        return self._backlog

    def _queue_signal(self) -> None:
        """The store says queued work may be claimable (a ``SignalsQueue`` callback, or a
        wake-up). A runner with ``recover=False`` adopts no work but its own: it listens only
        while tasks it queued may still wait."""
        if not self.recover and not self._queued_here:
            return
        self._backlog = True
        self._backlog_events += 1
        if self._free_slots() > 0:
            self._drain_soon()

    def _drain_soon(self) -> None:
        """Fill free slots in the background (at most one filler runs; a request made while
        it runs makes it look again)."""
        if self._filling:
            self._fill_again = True
            return
        if not self.running or self._nursery is None:
            return
        self._filling = True
        self._nursery.start_soon(self._fill_slots)

    async def _fill_slots(self) -> None:
        """Due retries waiting for a slot first, then queued work from the store."""
        try:
            while True:
                self._fill_again = False
                while self._awaiting_slot and self._free_slots() > 0 and self.running:
                    task_id = self._awaiting_slot.popleft()
                    if task_id not in self._jobs:
                        await self._claim_retry(task_id)
                if self._may_drain():
                    try:
                        await self._claim_queued(self.max_jobs, _PARALLEL_CLAIMS)
                    except Exception:
                        log.exception("claiming queued work failed; trying again")
                        await trio.sleep(self.release_retry_ms / 1000)
                        self._fill_again = True
                if not self._fill_again or not self.running:
                    return
        finally:
            self._filling = False

    async def _claim_queued(self, limit: int, parallel: int = 1) -> int:
        """Claim and start up to ``limit`` claimable tasks with ``claim_next`` while slots are
        free; return how many. With ``parallel`` several claims are in flight at once (a store
        serialises them in order, and a SQLite lane runs those queued behind each other in one
        thread hop), so a draining queue refills the slots at the store's pace, not one round
        trip at a time. Recovery passes claim one at a time: a claim that must first wait for
        a replaced attempt to exit is followed by the next claim, not by a pass already over."""
        adopted = 0
        exhausted = False
        failure: Exception | None = None

        async def claimer() -> None:
            nonlocal adopted, exhausted, failure
            while (
                not exhausted
                and failure is None
                and adopted < limit
                and self._free_slots() > 0
                and self.running
            ):
                adopted += 1  # reserved before the call: other claimers see it
                started = trio.current_time()
                events = self._backlog_events
                self._claiming += 1
                try:
                    claimed = await self.store.claim_next(self.owner_id, self.lease_ms)
                    if claimed is not None:
                        await self._start(claimed, "recovery", trio.current_time() - started)
                except Exception as error:
                    adopted -= 1
                    failure = failure or error
                    return
                finally:
                    self._claiming -= 1
                if claimed is None:
                    adopted -= 1
                    exhausted = True
                    # Corrected at once, not when the other claims in flight return (a
                    # creation meanwhile need not ask the store again), unless work may
                    # have been queued or signalled since this call was made.
                    if self._backlog_events == events:
                        self._backlog = False
                        self._queued_here = 0  # nothing claimable is left (for this runner)
                    return

        parallel = min(limit, self._free_slots(), parallel)
        if parallel == 1:
            await claimer()
        elif parallel > 1:
            async with trio.open_nursery() as nursery:
                for _ in range(parallel):
                    nursery.start_soon(claimer)
        if failure is not None:
            raise failure
        self._queued_here = max(0, self._queued_here - adopted)
        if not exhausted:
            self._backlog = self._backlog or adopted > 0
        return adopted

    # -- one attempt ---------------------------------------------------------------------

    async def _job_main(self, job: _Job) -> None:
        """One attempt, inside the instrumentation's attempt scope (a trace span)."""
        with ins.attempt_scope(
            self.instrumentation,
            task_id=job.task_id,
            generation=job.lease.generation,
            source=job.source,
            tool=work_tool(job.work),
            work_type=job.work.type,
            trace_context=job.work.trace_context,
            claim_duration=job.claim_duration,
        ):
            await self._attempt(job)

    async def _attempt(self, job: _Job) -> None:
        """One attempt. Its heartbeat and runtime limit are started by the runner's timer only
        when due (see _spawn_helper), so an attempt that ends sooner never has them, and needs
        no nursery of its own."""
        try:
            with job.scope:
                self._add_timers(job)
                try:
                    outcome = await self._execute(job)
                    await self._settle(job, outcome)
                finally:
                    self._drop_timers(job)
        finally:
            if job.helpers:
                with trio.CancelScope(shield=True):
                    await self._stop_helpers(job)
            if job.released:  # settled: nothing left to await, so no shield is needed
                self._finished(job, "ok")
            else:
                with trio.CancelScope(shield=True):
                    await self._finish(job)

    def _add_timers(self, job: _Job) -> None:
        now = trio.current_time()
        tables = [(self._heartbeat_due, self.heartbeat_ms)]
        if self.max_runtime_ms is not None:
            tables.append((self._runtime_due, self.max_runtime_ms))
        for due, interval_ms in tables:
            if not due:  # a new head: the timer may be waiting for something later
                if due is self._heartbeat_due and self._batch_renewal:
                    self._renewal_added.set()
                else:
                    self._timer_added.set()
            due[job] = now + interval_ms / 1000

    def _drop_timers(self, job: _Job) -> None:
        self._heartbeat_due.pop(job, None)
        self._runtime_due.pop(job, None)

    async def _timer_loop(self) -> None:
        """Start each attempt's heartbeat (unless the renewal loop renews in batches) and
        runtime limit in its own nursery when due."""
        tables: list[tuple[dict[_Job, float], Callable[[_Job], Awaitable[None]]]] = [
            (self._runtime_due, self._runtime_limit)
        ]
        if not self._batch_renewal:
            tables.append((self._heartbeat_due, self._heartbeat))
        while True:
            earliest = math.inf
            for due, _ in tables:
                if due:
                    earliest = min(earliest, next(iter(due.values())))
            with trio.move_on_at(earliest):
                await self._timer_added.wait()
            self._timer_added = trio.Event()
            now = trio.current_time()
            for due, helper in tables:
                while due:
                    job, at = next(iter(due.items()))
                    if at > now:
                        break
                    del due[job]
                    self._spawn_helper(job, helper)

    def _spawn_helper(self, job: _Job, helper: Callable[[_Job], Awaitable[None]]) -> None:
        """Run ``helper(job)`` beside the attempt, in a scope the attempt's stop cancels (as if
        it ran inside ``job.scope``); the attempt waits for it before it finishes."""
        if job.scope.cancel_called:
            return  # a stopped attempt: the helper would be cancelled at once anyway
        assert self._nursery is not None
        scope = trio.CancelScope()
        if job.helpers is None:
            job.helpers = set()
        job.helpers.add(scope)
        self._nursery.start_soon(self._run_helper, job, helper, scope)

    @staticmethod
    async def _run_helper(
        job: _Job, helper: Callable[[_Job], Awaitable[None]], scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                await helper(job)
        finally:
            assert job.helpers is not None
            job.helpers.discard(scope)
            if not job.helpers and job.helpers_idle is not None:
                job.helpers_idle.set()

    @staticmethod
    async def _stop_helpers(job: _Job) -> None:
        """Cancel the attempt's helpers and wait until they have exited."""
        assert job.helpers is not None
        job.helpers_idle = trio.Event()
        for scope in job.helpers:
            scope.cancel()
        while job.helpers:
            await job.helpers_idle.wait()

    async def _execute(self, job: _Job) -> Outcome:
        executor = self.executor
        if executor is None:
            return Failed(internal_error(NO_EXECUTOR), NO_EXECUTOR)
        try:
            value = await executor.execute(job.work, job.token, self.executor_state)
        except StepError as error:  # a step of a WorkExecutor (token.step) failed the task
            return Failed(error.to_error(), str(error))
        except ExceptionGroup as group:  # steps run in the executor's nursery
            step_error = only_step_errors(group)
            if step_error is not None:
                return Failed(step_error.to_error(), str(step_error))
            log.exception("executor failed for task %s", job.task_id)
            return Failed(internal_error(EXECUTOR_FAILED), EXECUTOR_FAILED)
        except Exception:
            log.exception("executor failed for task %s", job.task_id)
            return Failed(internal_error(EXECUTOR_FAILED), EXECUTOR_FAILED)
        try:
            return validate_outcome(value)
        except (TypeError, ValueError) as error:
            log.error("executor returned an invalid outcome for task %s: %s", job.task_id, error)
            return Failed(internal_error(EXECUTOR_FAILED), EXECUTOR_FAILED)

    async def _settle(self, job: _Job, outcome: Outcome) -> None:
        if job.stop_reason is not None:
            return
        job.settling = True
        if isinstance(outcome, Completed):
            # validate_outcome made the result a checked copy of the runner's own.
            event = completed_event(outcome.result)
            job.outcome = "completed"
        elif isinstance(outcome, Retry):
            event = Event.retry_requested(outcome.error, outcome.message)
            job.outcome = "retry"
        else:
            event = Event.failed(outcome.error, outcome.message)
            job.outcome = "failed"
        result = await self._commit_worker(job, event, settle=True)
        if result is None:
            job.store_outcome = "error"
            return
        job.store_outcome = result.outcome
        job.terminal = result.snapshot.task.status.is_terminal
        retry = result.effects.retry
        if (
            event.kind == EventKind.RETRY_REQUESTED
            and retry is not None
            and retry.disposition == "scheduled"
            and not job.terminal
        ):
            delay = 0 if result.outcome == "duplicate" else (retry.delay_ms or 0)
            job.retry_delay_ms = delay
            self._emit(
                ins.RETRY_SCHEDULED,
                {"delay_ms": delay, "retry_count": retry.retry_count},
                {"task_id": job.task_id},
            )

    async def _finish(self, job: _Job) -> None:
        released: Literal["ok", "stale", "pending"] = "ok"
        if not job.released:  # a settling store released it with the final event
            retry = job.retry_delay_ms is not None and job.stop_reason is None
            # The lease is read under its lock: a batch renewal in flight may replace it.
            async with job.lease_lock:
                released = await self._release(job.lease, retry=retry)
        self._finished(job, released)

    def _finished(self, job: _Job, released: Literal["ok", "stale", "pending"]) -> None:
        """The end of an attempt once its claim is released (or its release is pending)."""
        retry = job.retry_delay_ms is not None and job.stop_reason is None
        release_outcome = "ok" if released == "ok" else "error"
        for waiter in job.waiters.values():
            waiter.fail(StaleAttempt(job.task_id))
        if self._jobs.get(job.task_id) is job:
            del self._jobs[job.task_id]
        self._stopped_count += 1
        # An attempt whose final event was committed reports that outcome, even when a stop
        # (the runner's, say) was asked for while the commit was under way.
        settled = job.settling and job.store_outcome in ("applied", "duplicate")
        outcome = job.outcome if settled else job.stop_reason or job.outcome
        self._emit(
            ins.JOB_STOP,
            {"duration": trio.current_time() - job.started_at, "jobs": len(self._jobs)},
            {
                "task_id": job.task_id,
                "outcome": outcome,
                "store_outcome": job.store_outcome,
                "release_outcome": release_outcome,
                "source": job.source,
                "tool": work_tool(job.work),
            },
        )
        if job.terminal:
            self._forget_context(job.task_id)
        job.ended = True
        if job.ended_event is not None:
            job.ended_event.set()
        if job.stop_reason == "suspended":
            self._park_context(job.task_id)
            if job.wake_delay_ms is not None:
                self._wake_later(job.task_id, job.wake_delay_ms)
            elif released == "ok":
                # An answer that came while this claim was still held (after the suspension
                # was committed) found the task unavailable, here or on another host: claim
                # it once more now (the store defers it if it is still waiting).
                self._schedule_retry(job.task_id, 0)
        if retry and released != "pending":
            # After a stale release the store decides when the retry is due (delay 0 rechecks).
            assert job.retry_delay_ms is not None
            self._schedule_retry(job.task_id, job.retry_delay_ms if released == "ok" else 0)
        if self._free_slots() > 0 and (self._awaiting_slot or self._may_drain()):
            self._drain_soon()

    async def _release(
        self, lease: Lease, *, retry: bool = False
    ) -> Literal["ok", "stale", "pending"]:
        """Release a claim; a store failure keeps retrying in the background (``pending``).

        With ``retry``, a pending release schedules the task's retry once it has gone through:
        before that the task's own claim would make the retry's claim ``unavailable``.
        """
        try:
            await self.store.release(lease)
            return "ok"
        except StaleLease:
            return "stale"
        except Exception:
            log.exception("releasing the lease of task %s failed; retrying", lease.task_id)
            if self._nursery is not None and not self._stopped.is_set():
                self._nursery.start_soon(self._release_later, lease, retry)
            return "pending"

    async def _release_later(self, lease: Lease, retry: bool) -> None:
        while True:
            await trio.sleep(self.release_retry_ms / 1000)
            try:
                await self.store.release(lease)
                break
            except StaleLease:
                break
            except Exception:
                log.debug("release of task %s still failing", lease.task_id)
        if retry:
            self._schedule_retry(lease.task_id, 0)  # the store's retry_at decides

    def _request_stop(self, job: _Job, reason: str) -> None:
        if job.stop_reason is None:
            job.stop_reason = reason
        job.token.cancel()
        job.scope.cancel()
        for helper in job.helpers or ():
            helper.cancel()

    async def _stop_job(self, job: _Job, reason: str) -> None:
        """Cancel an attempt's scope and wait until it has exited (its lease is released)."""
        self._request_stop(job, reason)
        if job.ended:
            await trio.lowlevel.checkpoint()  # (as waiting for a set event does)
            return
        if job.ended_event is None:
            job.ended_event = trio.Event()
        await job.ended_event.wait()

    async def _renewal_loop(
        self, renew: Callable[[list[_Job], trio.Event], Awaitable[None]]
    ) -> None:
        """Every attempt's heartbeat in one store call (a store that offers ``renew_owner``,
        :meth:`_renew_owner_batch`, or ``renew_all``, :meth:`_renew_batch`).

        It waits until the earliest attempt's heartbeat is due (``heartbeat_ms`` after its
        start, or after its previous renewal), then renews every running attempt's lease in one
        ``renew_all``, so a runner makes one commit per heartbeat however many attempts it runs
        (an attempt started since the previous batch is renewed early, which costs nothing
        extra). Fencing stays per attempt: a lost lease stops that attempt alone, as a single
        renewal's ``StaleLease`` does. An attempt whose lease lock is held (a commit of its own
        is in flight) is renewed by itself once the commit is done. A revision the runner did
        not write makes the attempt re-read its task (answers or a cancellation committed
        elsewhere), which replaces the re-read every single heartbeat does.
        """
        while True:
            due = self._heartbeat_due
            if not due and self._following:
                self._forget_following()
            earliest = next(iter(due.values())) if due else math.inf
            with trio.move_on_at(earliest):
                await self._renewal_added.wait()
            self._renewal_added = trio.Event()
            now = trio.current_time()
            due = self._heartbeat_due
            if not due or next(iter(due.values())) > now:
                continue
            # Every attempt's next heartbeat is one interval from now, set before the call, so
            # attempts started meanwhile come after them (insertion order is due order).
            jobs = list(due)
            self._heartbeat_due = dict.fromkeys(jobs, now + self.heartbeat_ms / 1000)
            marked = trio.Event()
            batch: list[_Job] = []
            for job in jobs:
                if job.released or job.stop_reason is not None:
                    continue  # settled or stopping: nothing to renew
                guard = job.lease_lock
                if guard.locked():
                    self._spawn_helper(job, self._renew_alone)
                    continue
                guard.batch = marked
                batch.append(job)
            if batch:
                try:
                    await renew(batch, marked)
                finally:
                    for job in batch:
                        job.lease_lock.batch = None
                    marked.set()

    async def _renew_batch(self, store: RenewsLeases, batch: list[_Job], _: trio.Event) -> None:
        """``renew_all`` for ``batch``, whose attempts wait for it before using their lease."""
        try:
            results = await store.renew_all(
                self.owner_id, [job.lease for job in batch], self.lease_ms
            )
            if len(results) != len(batch):
                raise RuntimeError("renew_all answered for another number of leases")
        except Exception:
            # A transient store failure is not a lost lease: the store decides that, and
            # the next heartbeat gets LEASE_LOST once a claim has really lapsed.
            log.exception("renewing %d leases failed; retrying next heartbeat", len(batch))
            return
        sink = self.instrumentation
        for job, result in zip(batch, results, strict=True):
            if result is LEASE_LOST:
                self._emit(
                    ins.LEASE_LOST, {"generation": job.lease.generation}, {"task_id": job.task_id}
                )
                self._request_stop(job, "stale_lease")
                continue
            job.lease = result.lease
            if sink is not None:
                self._emit(
                    ins.LEASE_RENEWED,
                    {"generation": job.lease.generation},
                    {"task_id": job.task_id},
                )
            if result.revision > job.revision:
                self._spawn_helper(job, self._refresh)

    async def _renew_owner_batch(
        self, store: RenewsOwnerLease, batch: list[_Job], marked: trio.Event
    ) -> None:
        """``renew_owner`` for ``batch`` (its attempts are ``marked`` and wait for it before
        using their lease): one answer for the whole batch, so a heartbeat makes no object per
        attempt. Each attempt passes the lease it holds; a claim renewed here follows the owner
        lease, whose expiry is the runner's to remember and every following attempt's exact
        lease is built from (see ``_Job.lease``).

        A following claim left out of the batch (its lock was busy, it is ending) keeps the
        expiry it has as its own in the store, so its attempt takes that exact lease as its own
        first. A lost lease stops its attempt alone; an owner lease that lapsed loses them all,
        as their leases would have. A transient failure changes nothing here: the store either
        committed nothing, or the next batch finds the owner lease's expiry not the one passed
        and loses every following lease (the runner cannot know the claims it holds then)."""
        owner = self._owner_lease
        for job in self._following:
            if job.owner is not None and job.lease_lock.batch is not marked:
                job.lease = job.lease  # left out: the expiry it has becomes its own
        self._following = batch
        try:
            answer = await store.renew_owner(
                self.owner_id,
                [job.held for job in batch],
                [job.revision for job in batch],
                owner.expires_at,
                self.lease_ms,
            )
        except Exception:
            # A transient store failure is not a lost lease: the store decides that, and
            # the next heartbeat finds the claims lost once they have really lapsed.
            log.exception("renewing %d leases failed; retrying next heartbeat", len(batch))
            return
        owner.expires_at = answer.expires_at
        lost = answer.lost
        if lost:
            gone = set(lost)
            for index, job in enumerate(batch):
                if index in gone:
                    job.owner = None  # its claim no longer follows the owner lease
                    self._emit(
                        ins.LEASE_LOST,
                        {"generation": job.held.generation},
                        {"task_id": job.task_id},
                    )
                    self._request_stop(job, "stale_lease")
                else:
                    job.owner = owner
        else:
            for job in batch:
                job.owner = owner
        if self.instrumentation is not None:
            gone = set(lost)
            for index, job in enumerate(batch):
                if index not in gone:
                    self._emit(
                        ins.LEASE_RENEWED,
                        {"generation": job.held.generation},
                        {"task_id": job.task_id},
                    )
        for index in answer.changed:
            self._spawn_helper(batch[index], self._refresh)

    def _forget_following(self) -> None:
        """No attempt is due (all those of the last batch have ended, or are ending) and no
        batch is in flight: each that still follows the owner lease takes its exact lease as
        its own (nothing will move it any more), and the runner keeps none of them."""
        for job in self._following:
            if job.owner is not None:
                job.lease = job.lease
        self._following = []

    async def _renew_alone(self, job: _Job) -> None:
        """One heartbeat of one attempt, on a batch-renewing store (its lock was busy)."""
        await self._renew_once(job)

    async def _renew_once(self, job: _Job) -> bool:
        """Renew one attempt's lease and re-read its task; ``False``: the attempt is over."""
        try:
            async with job.lease_lock:
                if job.released:  # settled: the claim is gone, the attempt is ending
                    return False
                job.lease = await self.store.renew(job.lease, self.lease_ms)
                snapshot = await self.store.worker_snapshot(job.task_id, job.lease)
        except StaleLease:
            self._emit(
                ins.LEASE_LOST,
                {"generation": job.lease.generation},
                {"task_id": job.task_id},
            )
            self._request_stop(job, "stale_lease")
            return False
        except Exception:
            # A transient store failure is not a lost lease: the store decides that, and
            # the next renewal gets StaleLease once the claim has really lapsed.
            log.exception("renewing the lease of task %s failed; retrying", job.task_id)
            return True
        self._emit(
            ins.LEASE_RENEWED,
            {"generation": job.lease.generation},
            {"task_id": job.task_id},
        )
        if isinstance(snapshot, NotFound):
            self._request_stop(job, "expired")
            return False
        self._reconcile(job, snapshot)
        return True

    async def _heartbeat(self, job: _Job) -> None:
        """Renew now (the first heartbeat is due), then every ``heartbeat_ms`` (a store
        without ``renew_all``: one renewal and one re-read per attempt and heartbeat)."""
        while True:
            if not await self._renew_once(job):
                return
            await trio.sleep(self.heartbeat_ms / 1000)

    def _reconcile(self, job: _Job, snapshot: Snapshot) -> None:
        """Deliver inbox answers accepted elsewhere; stop if the task ended elsewhere."""
        job.revision = max(job.revision, snapshot.revision)
        if snapshot.task.status.is_terminal and not job.settling:
            job.terminal = True
            reason = "cancelled" if snapshot.task.status == TaskStatus.CANCELLED else "stopped"
            self._request_stop(job, reason)
            return
        for key, waiter in job.waiters.items():
            response = snapshot.accepted_input_responses.get(key)
            if response is not None:
                waiter.deliver(response)

    async def _runtime_limit(self, job: _Job) -> None:
        """The attempt has run ``max_runtime_ms`` (started by the timer when due)."""
        # Spawned helpers run their first lines even when their scope was cancelled before
        # they started: yield first, so a stopped attempt is never marked ``max_runtime``.
        await trio.lowlevel.checkpoint()
        if job.stop_reason is not None or job.settling:
            return
        job.stop_reason = "max_runtime"
        result = await self._commit_worker(
            job, Event.failed(internal_error(MAX_RUNTIME), MAX_RUNTIME)
        )
        if result is not None:
            job.store_outcome = result.outcome
            job.terminal = result.snapshot.task.status.is_terminal
        self._request_stop(job, "max_runtime")

    # -- input ---------------------------------------------------------------------------

    async def _await_input(self, job: _Job, key: str, request: JSONObject) -> JSONObject:
        if self._jobs.get(job.task_id) is not job or job.stop_reason is not None:
            raise StaleAttempt(job.task_id)
        if not isinstance(key, str) or not key:
            raise ValueError("an input key must be a non-empty string")
        self._no_step_body("await_input")
        request = ensure_json_object(request, what="input request")
        if not isinstance(request.get("method"), str) or not request["method"]:
            raise ValueError("an input request needs a non-empty string method")
        context = job.token.context
        if context is not None:
            require_input_request(dict(context.client_capabilities), request)
        if key in job.waiters:
            raise DuplicateInputKey(key)
        if key in job.steps or key in job.step_keys:
            raise DuplicateInputKey(key)
        job.input_keys.add(key)
        waiter = _Waiter()
        job.waiters[key] = waiter
        try:
            await self._register_input(job, key, request, waiter)
            await self._wait_for_input(job, key, waiter)
        finally:
            if job.waiters.get(key) is waiter:
                del job.waiters[key]
        if waiter.error is not None:
            raise waiter.error
        assert waiter.response is not None
        return waiter.response

    async def _wait_for_input(self, job: _Job, key: str, waiter: _Waiter) -> None:
        """Wait for the answer; past ``suspend_input_after_ms`` suspend the task instead."""
        threshold = self.suspend_input_after_ms
        while not waiter.event.is_set():
            if threshold is None:
                await waiter.event.wait()
                return
            with trio.move_on_after(threshold / 1000):
                await waiter.event.wait()
            if not waiter.event.is_set():
                await self._suspend(job, key)  # returns only when there was nothing to wait for

    async def _register_input(
        self, job: _Job, key: str, request: JSONObject, waiter: _Waiter
    ) -> None:
        """Replay, re-attach to, or newly request input ``key`` (keys are unique for life)."""
        try:
            async with job.lease_lock:
                snapshot = await self.store.worker_snapshot(job.task_id, job.lease)
        except StaleLease:
            raise StaleAttempt(job.task_id) from None
        if isinstance(snapshot, NotFound):
            raise StaleAttempt(job.task_id)
        history = snapshot.input_history.get(key)
        if history is not None:
            if history != request:
                raise DuplicateInputKey(key)
            answered = snapshot.accepted_input_responses.get(key)
            if answered is not None:
                waiter.deliver(answered)
                return
            if key in snapshot.task.input_requests:
                return
            raise DuplicateInputKey(key)
        if snapshot.task.status.is_terminal:
            raise StaleAttempt(job.task_id)
        job.revision = max(job.revision, snapshot.revision)
        result = await self._commit_worker(job, Event.input_requested(key, request))
        if result is None or result.outcome == "unchanged":
            raise StaleAttempt(job.task_id)

    # -- durable steps -------------------------------------------------------------------

    @staticmethod
    def _no_step_body(what: str) -> None:
        body = _STEP_BODY.get()
        if body is not None:
            raise StepMisuse(
                f"{what} inside the body of step {body!r}: a step body may not use the task "
                "context (run it between steps)"
            )

    def _use_key(self, job: _Job, key: str, what: str) -> None:
        """The checks every step and sleep makes first: a live attempt, outside any step
        body, with a key this attempt has not used yet."""
        if self._jobs.get(job.task_id) is not job or job.stop_reason is not None:
            raise StaleAttempt(job.task_id)
        check_step_key(key)
        self._no_step_body(what)
        if key in job.step_keys or key in job.input_keys:
            # (an input key too, before any body runs: the store would refuse its commit)
            raise DuplicateStepKey(key)
        job.step_keys.add(key)

    async def _commit_step(self, job: _Job, event: Event) -> Transition:
        """Commit a step event under the attempt's lease (its id derived from task and key,
        so a resend after a lost acknowledgement replays); a refused one ends the step."""
        try:
            result = await self._commit_worker(job, event)
        except StepLimitExceeded as exc:
            raise StepTooLarge(exc.key, str(exc).split(": ", 1)[-1]) from None
        except (StepKeyReused, DuplicateInputKey):
            raise DuplicateStepKey(event.data["key"]) from None
        if result is None or result.outcome == "unchanged":
            # Fenced (a later attempt owns the task) or the task is terminal (cancelled): the
            # store refused the step, and this attempt is over.
            raise StaleAttempt(job.task_id)
        job.steps = result.snapshot.steps
        return result

    async def _step(
        self,
        job: _Job,
        key: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        fingerprint: str | None,
        timeout_s: float | None,
        retry: Sequence[int],
        semantics: Semantics,
        thread: bool,
    ) -> Any:
        """``ctx.step``: the recorded outcome of ``key``, or run ``fn`` and record it."""
        timeout_s, delays = check_step_options(timeout_s, retry, semantics)
        if not callable(fn):
            raise TypeError("a step needs a callable")
        if not thread and not _is_async(fn):
            raise TypeError(
                "a step function must be async; run a sync one with thread=True "
                "(it runs in a worker thread and may poll ctx.cancelled)"
            )
        if thread and _is_async(fn):
            raise TypeError(
                "thread=True runs a sync function in a worker thread; await an async one "
                "without it (in the thread it would only make a coroutine, never run)"
            )
        self._use_key(job, key, "ctx.step")
        if fingerprint is None:
            fingerprint = step_fingerprint(key, args, kwargs)
        elif not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 256:
            raise ValueError("fingerprint must be a string of 1..256 characters")
        record = job.steps.get(key)
        if record is not None:
            return self._replayed(key, record, fingerprint)
        task_id = job.task_id
        if semantics == "at_most_once":
            started = derived_event_id(task_id, EventKind.STEP_STARTED, key)
            await self._commit_step(job, Event.step_started(key, fingerprint, id=started))
        outcome = await self._run_step_body(job, key, fn, args, kwargs, timeout_s, delays, thread)
        recorded = derived_event_id(task_id, EventKind.STEP_RECORDED, key)
        await self._commit_step(job, Event.step_recorded(key, fingerprint, outcome, id=recorded))
        if "error" in outcome:
            raise StepFailed.from_error(outcome["error"], key)
        return outcome["result"]

    @staticmethod
    def _replayed(key: str, record: JSONObject, fingerprint: str) -> Any:
        if record["kind"] != "step":
            raise StepMismatch(key, SLEEP_FINGERPRINT, fingerprint)
        if record["fingerprint"] != fingerprint:
            raise StepMismatch(key, record["fingerprint"], fingerprint)
        outcome = record["outcome"]
        if outcome is None:
            raise StepInterrupted(key)
        if "error" in outcome:
            raise StepFailed.from_error(outcome["error"], key)
        return outcome["result"]  # the attempt's own copy (a snapshot the store handed out)

    async def _run_step_body(
        self,
        job: _Job,
        key: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout_s: float | None,
        delays: tuple[int, ...],
        thread: bool,
    ) -> JSONObject:
        """Run the body (again after each delay of its in-attempt retry list while it raises
        anything but :class:`StepFailed` or a step error) and check its outcome."""
        tries = 0
        outcome: JSONObject
        while True:
            marker = _STEP_BODY.set(key)
            try:
                value = await _call_body(fn, args, kwargs, timeout_s, thread)
            except StepFailed as failed:
                outcome = {"error": failed.error}
                what = "error"
            except StepError:
                raise
            except Exception:
                if tries >= len(delays):
                    raise
                delay = delays[tries]
                tries += 1
                log.info("step %r of task %s failed; retrying in %d ms", key, job.task_id, delay)
                await trio.sleep(delay / 1000)
                continue
            else:
                try:
                    outcome = {"result": ensure_json(value, what=f"the result of step {key!r}")}
                except InvalidJSON as exc:
                    raise StepTooLarge(key, f"its result is not JSON ({exc})") from None
                what = "result"
            finally:
                _STEP_BODY.reset(marker)
            # The limit of a step_recorded event, checked before the commit for a result and a
            # StepFailed's error alike: an oversized outcome fails the task without a retry.
            size = json_size(outcome)
            if size > MAX_STEP_OUTCOME_BYTES:
                raise StepTooLarge(
                    key,
                    f"its {what} is {size} bytes of JSON; a step outcome is limited to "
                    f"{MAX_STEP_OUTCOME_BYTES} (store large data elsewhere, record its key)",
                )
            return outcome

    async def _sleep(self, job: _Job, key: str, seconds: float) -> None:
        """``ctx.sleep``: a durable sleep whose wake instant is on the store's clock."""
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ValueError("a sleep takes a finite number of seconds >= 0")
        delay_ms = math.ceil(seconds * 1000)
        if delay_ms > MAX_DELAY_MS:
            raise ValueError(f"a sleep is at most {MAX_DELAY_MS // 1000} seconds")
        self._use_key(job, key, "ctx.sleep")
        record = job.steps.get(key)
        if record is None:
            event_id = derived_event_id(job.task_id, EventKind.SLEEP_SCHEDULED, key)
            await self._commit_step(job, Event.sleep_scheduled(key, delay_ms, id=event_id))
            record = job.steps[key]
        wake_at = step_wake_at(record)
        if wake_at is None:
            raise StepMismatch(key, record["fingerprint"], SLEEP_FINGERPRINT)
        while True:
            remaining_ms = -(-(wake_at - await self.store.now()) // 1000)
            if remaining_ms <= 0:
                return
            threshold = self.suspend_sleep_after_ms
            if threshold is None or remaining_ms <= threshold:
                await trio.sleep(remaining_ms / 1000)
                continue
            await self._suspend(job, key, remaining_ms)

    async def _suspend(self, job: _Job, key: str, wake_delay_ms: int | None = None) -> None:
        """End the attempt with a suspension (lease and slot released, no retry consumed).

        Returns only when the store found nothing to wait for (the sleep is due, the input
        was answered meanwhile); otherwise the attempt is stopped and this never returns.
        """
        event_id = derived_event_id(job.task_id, EventKind.SUSPENDED, key, job.lease.generation)
        result = await self._commit_worker(job, Event.suspended(key, id=event_id))
        if result is None or result.snapshot.task.status.is_terminal:
            raise StaleAttempt(job.task_id)
        if result.outcome == "unchanged" or result.snapshot.suspended_key != key:
            self._reconcile(job, result.snapshot)  # deliver an answer that arrived meanwhile
            return
        job.wake_delay_ms = wake_delay_ms
        self._request_stop(job, "suspended")
        await trio.sleep_forever()

    # -- background loops ----------------------------------------------------------------

    async def _recovery_loop(self) -> None:
        while True:
            now = trio.current_time()
            while self._wakes and self._wakes[0] <= now:
                self._wakes.pop(0)
            try:
                await self.recover_once()
            except Exception:
                log.exception("recovery pass failed")
            deadline = trio.current_time() + self.recovery_interval_ms / 1000
            if self._wakes:
                deadline = min(deadline, self._wakes[0])
            with trio.move_on_at(deadline):
                await self._recover_soon.wait()
            self._recover_soon = trio.Event()

    def _wake_later(self, task_id: str, delay_ms: int) -> None:
        """A task this runner suspended for a durable sleep is due in ``delay_ms``.

        A recovering runner keeps the instant (at most :data:`MAX_KNOWN_WAKES` of the earliest,
        so suspended tasks cost it bounded memory, never a task or a timer each) and runs its
        recovery pass then, which claims whatever is due; polling covers the rest. A runner
        without recovery claims the task itself when it is due.
        """
        if self.recover:
            at = trio.current_time() + delay_ms / 1000
            wakes = self._wakes
            if len(wakes) >= MAX_KNOWN_WAKES and at >= wakes[-1]:
                return  # later than every wake kept: the polling finds it
            bisect.insort(wakes, at)
            if len(wakes) > MAX_KNOWN_WAKES:
                wakes.pop()
            if wakes[0] == at:
                self._recover_soon.set()  # the loop then waits for this earlier instant
        else:
            self._schedule_retry(task_id, delay_ms)

    def _poke_recovery(self, delay_s: float = 0.0) -> None:
        """Run a recovery pass now (or after ``delay_s``) instead of at the next poll."""
        if not self.recover or self._nursery is None or self._stopping.is_set():
            return
        if delay_s <= 0:
            self._recover_soon.set()
            return

        async def later() -> None:
            await trio.sleep(delay_s)
            self._recover_soon.set()

        self._nursery.start_soon(later)

    async def _wakeup_loop(self, store: OffersWakeups) -> None:
        """React to the store's wake-up hints (e.g. PostgreSQL NOTIFY) within milliseconds.

        Hints are never the authority: a new task or a due retry triggers a recovery pass (the
        store decides what is claimable); an accepted input or a cancellation committed
        elsewhere makes the local attempt re-read its task at once instead of at its next
        heartbeat. Polling and heartbeats remain the safety net.
        """
        while True:
            try:
                async with contextlib.aclosing(store.wakeups()) as stream:
                    async for wakeup in stream:
                        await self._on_wakeup(wakeup)
                return
            except Exception:
                log.exception("the store's wake-up stream failed; polling until it is back")
                await trio.sleep(self.recovery_interval_ms / 1000)

    async def _changes_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hand the store's changes to the watchers (see :meth:`watch`); restart on failure.

        A restarted iteration begins with ``resync``, so watchers re-read what they watch.
        """
        assert offers_changes(self.store)
        started = False
        while True:
            try:
                async with contextlib.aclosing(self.store.changes()) as stream:
                    async for change in stream:
                        if not started:  # the first item (resync): the feed is registered
                            task_status.started()
                            started = True
                        if isinstance(change, TaskChange):
                            self._announce(change)
                return
            except Exception:
                log.exception("the store's change stream failed; restarting it")
                if not started:
                    task_status.started()
                    started = True
                await trio.sleep(self.recovery_interval_ms / 1000)
            finally:
                if not started:
                    task_status.started()
                    started = True

    async def _on_wakeup(self, wakeup: Any) -> None:
        kind = str(getattr(wakeup, "kind", ""))
        task_id = getattr(wakeup, "task_id", None)
        local = bool(getattr(wakeup, "local", False))
        if kind in ("resync", "created", "released"):
            # Queued or freed work (a task created queued, a claim released): fill free slots
            # now. A local creation is heard too: another runner on this store object may have
            # queued it.
            self._queue_signal()
        if kind == "resync":
            self._poke_recovery()
        elif kind == "retry_scheduled":
            due_at = getattr(wakeup, "due_at", None)
            delay = 0.0
            if isinstance(due_at, int):
                delay = max(0.0, (due_at - await self.store.now()) / 1_000_000)
            self._poke_recovery(delay)
        elif kind in ("input_accepted", "cancelled") and isinstance(task_id, str) and not local:
            job = self._jobs.get(task_id)
            if job is not None:
                await self._refresh(job)
            elif kind == "input_accepted":
                self._poke_recovery()  # it may have been suspended for this input

    async def _refresh(self, job: _Job) -> None:
        """Re-read a running attempt's task now (what a heartbeat does, without renewing)."""
        try:
            async with job.lease_lock:
                snapshot = await self.store.worker_snapshot(job.task_id, job.lease)
        except StaleLease:
            self._request_stop(job, "stale_lease")
            return
        if isinstance(snapshot, NotFound):
            self._request_stop(job, "expired")
            return
        self._reconcile(job, snapshot)

    async def recover_once(self) -> int:
        """Claim and start up to ``recovery_batch_size`` claimable tasks; return how many."""
        return await self._claim_queued(self.recovery_batch_size)

    async def _reap_loop(self) -> None:
        assert self.reap_interval_ms is not None
        while True:
            await trio.sleep(self.reap_interval_ms / 1000)
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaping failed")

    async def reap_once(self) -> list[str]:
        """Delete expired tasks in the store, then stop any local attempt of theirs."""
        reaped = await self.store.reap()
        if reaped:
            self._emit(ins.TASKS_REAPED, {"count": len(reaped)}, {})
            if self._watchers and not self._store_changes:
                for task_id in reaped:
                    self._announce(TaskChange("reaped", task_id))
        for task_id in reaped:
            await self._abandon(task_id, "expired")
        return reaped


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


async def _call_body(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    timeout_s: float | None,
    thread: bool,
) -> Any:
    """One run of a step body: async in this task, or sync in a worker thread (never
    abandoned: the attempt waits for it, and it may poll ``ctx.cancelled``)."""
    if thread:
        started = trio.current_time()
        value = await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        if timeout_s is not None and trio.current_time() - started > timeout_s:
            raise trio.TooSlowError  # a thread cannot be interrupted: its late result is void
        return value
    if timeout_s is None:
        return await fn(*args, **kwargs)
    with trio.fail_after(timeout_s):
        return await fn(*args, **kwargs)


class _JobCapacity(CapacityExceeded):
    """``max_jobs`` is reached on this runner (nothing was stored)."""

    def __init__(self) -> None:
        super().__init__("max_jobs")
