"""``renew_owner`` against a model, on the memory and SQLite stores: random sequences of claims,
batches (subsets, attempts left out, stale values passed), renewals alone, reads, releases,
clock moves, reaps, takeovers by another owner and runner restarts that reuse an owner id.

The callers act exactly as the runner does (``_Job.held``, one owner expiry per runner, a
following attempt left out of a batch takes its exact lease as its own first); the oracle is one
expiry per claim, as if each were renewed alone. After every step the store must agree: a
caller's exact lease is accepted iff its claim is live, no other value of it is, another owner
adopts a claim exactly at its expiry, and a batch loses exactly the leases whose claims lapsed.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import attrs
import pytest

from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, new_task
from tritask.tasks.store import (
    UNAVAILABLE,
    Action,
    Claimed,
    Lease,
    RenewsOwnerLease,
    StaleLease,
    Store,
    renews_owner_lease,
)
from tritask.tasks.work import Work
from tritask.testing.store_contract import ManualClock, by_tenant, tenant

A = tenant("tenant-a")
LEASES_MS = (3000, 5000, 9000)


@attrs.define(eq=False)
class Job:
    task_id: str
    held: Lease
    follows: bool = False
    expiry: int = 0
    """The oracle: the claim's true expiry."""
    old: list[Lease] = attrs.field(factory=list)
    """Values of this claim that are no longer exact (each must be refused unless equal)."""


@attrs.define(eq=False)
class Caller:
    """One runner's view: its owner id, owner expiry, attempts and the last batch."""

    owner: str
    owner_exp: int | None = None
    jobs: dict[str, Job] = attrs.field(factory=dict)
    following: list[Job] = attrs.field(factory=list)

    def exact(self, job: Job) -> Lease:
        if job.follows:
            assert self.owner_exp is not None
            return attrs.evolve(job.held, expires_at=self.owner_exp)
        return job.held


@asynccontextmanager
async def memory(clock: ManualClock, _: Path) -> AsyncIterator[Store]:
    async with MemoryStore(
        scope=by_tenant, clock=clock, max_tasks=None, max_active_tasks_per_scope=None
    ) as store:
        yield store


@asynccontextmanager
async def sqlite(clock: ManualClock, path: Path) -> AsyncIterator[Store]:
    from tritask_sqlite import SqliteStore

    async with SqliteStore(path / "model.db", scope=by_tenant, clock=clock) as store:
        yield store


Opener = Callable[[ManualClock, Path], AbstractAsyncContextManager[Store]]


def owner_renewer(store: Store) -> RenewsOwnerLease:
    assert renews_owner_lease(store)
    return store


async def run_model(opener: Opener, path: Path, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    async with opener(clock, path) as store:
        renewer = owner_renewer(store)
        callers = [Caller("owner-1"), Caller("owner-2")]
        abandoned: list[tuple[Caller, Job]] = []  # claims of restarted runners
        names = iter(range(10**6))

        def now() -> int:
            return clock()

        async def check_live(caller: Caller, job: Job) -> None:
            exact = caller.exact(job)
            live = now() < job.expiry
            try:
                got = await store.worker_snapshot(job.task_id, exact)
                ok = isinstance(got, Snapshot)
            except StaleLease:
                ok = False
            assert ok == live, (seed, job.task_id, exact, job.expiry, now())
            for value in job.old[-3:]:
                if value == exact:
                    continue
                with pytest.raises(StaleLease):
                    await store.worker_snapshot(job.task_id, value)

        for _ in range(steps):
            caller = rng.choice(callers)
            op = rng.random()
            mine = list(caller.jobs.values())
            if op < 0.15 or not mine:
                task_id = f"t{next(names)}"
                access = await store.authorize(A, Action.CREATE, task_id)
                await store.create(
                    new_task(task_id, await store.now(), 10**9, 5),
                    Work(idempotency_key=task_id, type="model", input={}),
                    access,
                )
                lease_ms = rng.choice(LEASES_MS)
                claimed = await store.claim(task_id, caller.owner, lease_ms)
                assert isinstance(claimed, Claimed)
                caller.jobs[task_id] = Job(task_id, claimed.lease, expiry=now() + lease_ms * 1000)
            elif op < 0.35:
                clock.advance(rng.choice((0, 1, 500, 1000, 2000, 2999, 3000, 4000)))
            elif op < 0.6:
                # A batch: some attempts left out (busy, ending), as the runner does.
                batch = [job for job in mine if rng.random() < 0.8]
                if not batch:
                    continue  # the runner never sends an empty batch
                in_batch = set(map(id, batch))
                for job in caller.following:
                    if job.follows and id(job) not in in_batch:
                        job.held, job.follows = caller.exact(job), False
                caller.following = batch
                lease_ms = rng.choice(LEASES_MS)
                answer = await renewer.renew_owner(
                    caller.owner,
                    [job.held for job in batch],
                    [0] * len(batch),
                    caller.owner_exp,
                    lease_ms,
                )
                at = now()
                expected_lost = tuple(i for i, job in enumerate(batch) if at >= job.expiry)
                assert answer.lost == expected_lost, (seed, answer, at, [j.expiry for j in batch])
                renewed = len(batch) - len(expected_lost)
                assert answer.expires_at == (at + lease_ms * 1000 if renewed else None)
                for index, job in enumerate(batch):
                    if index in expected_lost:
                        del caller.jobs[job.task_id]
                        job.follows = False
                        continue
                    job.old.append(caller.exact(job))  # stale once this batch moved it
                    job.follows = True
                    job.expiry = at + lease_ms * 1000
                caller.owner_exp = answer.expires_at
            elif op < 0.68:
                job = rng.choice(mine)
                exact = caller.exact(job)
                lease_ms = rng.choice(LEASES_MS)
                live = now() < job.expiry
                try:
                    renewed_lease = await store.renew(exact, lease_ms)
                except StaleLease:
                    assert not live, (seed, job.task_id)
                    del caller.jobs[job.task_id]
                    continue
                assert live, (seed, job.task_id)
                job.old.append(exact)
                job.held, job.follows = renewed_lease, False
                job.expiry = now() + lease_ms * 1000
            elif op < 0.78:
                job = rng.choice(mine)
                await check_live(caller, job)
            elif op < 0.84:
                job = rng.choice(mine)
                live = now() < job.expiry
                try:
                    await store.release(caller.exact(job))
                    released = True
                except StaleLease:
                    released = False
                # An expired claim nobody took over may still be released by its holder.
                if live:
                    assert released, (seed, job.task_id)
                del caller.jobs[job.task_id]
            elif op < 0.92:
                # Another owner tries to take over a claim: exactly at its expiry.
                pool = [(c, j) for c in callers for j in c.jobs.values()] + abandoned
                if not pool:
                    continue
                holder, job = rng.choice(pool)
                other = "heir" if rng.random() < 0.5 else rng.choice(callers).owner
                result = await store.claim(job.task_id, other, 1000)
                if now() < job.expiry:
                    assert result is UNAVAILABLE, (seed, job.task_id, job.expiry, now())
                    await check_live(holder, job)
                    continue
                assert isinstance(result, Claimed), (seed, job.task_id, result)
                await store.release(result.lease)
                holder.jobs.pop(job.task_id, None)
                if (holder, job) in abandoned:
                    abandoned.remove((holder, job))
            elif op < 0.96:
                await store.reap()
            else:
                # The runner restarts with the same owner id: its claims are abandoned
                # (adopted at their expiry), the new runner knows no owner expiry.
                for job in caller.jobs.values():
                    abandoned.append((caller, job))
                index = callers.index(caller)
                callers[index] = Caller(caller.owner)
            for holder, job in abandoned:
                if rng.random() < 0.1:
                    await check_live(holder, job)


@pytest.mark.parametrize("opener", [memory, sqlite], ids=["memory", "sqlite"])
@pytest.mark.parametrize("seed", range(8))
async def test_renew_owner_against_a_model(opener: Opener, seed: int, tmp_path: Path) -> None:
    await run_model(opener, tmp_path, seed, 300)
