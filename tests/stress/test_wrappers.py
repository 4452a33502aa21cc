"""The stress wrappers offer exactly the optional capabilities of the store they wrap.

Runners and the Tasks extension detect a store's optional capabilities on its class; a wrapper
that offered fewer would make a benchmark (whose server wraps its store in ``CountingStore``)
measure a runner a user's server never runs, e.g. one without the store's change feed.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

import tritask.tasks.store as store_module
from stress.wrappers import (
    CAPABILITIES,
    FAULTS,
    CountingStore,
    PartitionedStore,
    StoreProxy,
    capabilities,
)
from tritask.tasks.changes import TaskChange
from tritask.tasks.events import Event
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, RequestAuthority, Store, Transition
from tritask.tasks.stores import open_store
from tritask.tasks.work import Work

WORK = Work(idempotency_key="t1", type="job", input={})


def _stores(tmp_path: Path) -> dict[str, Store]:
    """One store of each built-in kind (none is opened: capabilities live on the class)."""
    return {
        "memory": MemoryStore(scope="shared"),
        "sqlite": open_store(f"sqlite:///{tmp_path / 'tasks.db'}", scope="shared"),
        "postgresql": open_store("postgresql://127.0.0.1:5432/test", scope="shared"),
    }


def test_every_optional_capability_of_the_store_module_is_known() -> None:
    """A capability added to tritask.tasks.store without a wrapper mixin fails here."""
    protocols = {
        name
        for name, value in vars(store_module).items()
        if inspect.isclass(value)
        and getattr(value, "_is_runtime_protocol", False)
        and value.__module__ == store_module.__name__
        and name != "Store"
    }
    assert protocols == set(CAPABILITIES)


def test_a_counting_store_offers_exactly_what_it_wraps(tmp_path: Path) -> None:
    for kind, inner in _stores(tmp_path).items():
        offered = capabilities(inner)
        assert "OffersChanges" in offered, kind
        assert capabilities(CountingStore(inner)) == offered, kind
        # Wrapped twice, still the same.
        assert capabilities(CountingStore(CountingStore(inner))) == offered, kind
        for fault in FAULTS.values():
            assert capabilities(fault(inner)) == offered, (kind, fault)
        assert capabilities(StoreProxy(inner)) == offered, kind
        # The one documented exception: a partition cuts single renewals, so no batches.
        assert capabilities(PartitionedStore(inner)) == offered - {
            "RenewsLeases",
            "RenewsOwnerLease",
        }, kind


def test_a_wrapper_offers_nothing_its_inner_store_lacks() -> None:
    class Minimal(StoreProxy):
        pass

    bare: Any = SimpleNamespace()  # a "store" offering no optional capability at all
    assert capabilities(CountingStore(bare)) == frozenset()
    assert capabilities(Minimal(bare)) == frozenset()


async def test_a_runner_on_a_counting_store_hears_changes_of_other_writers() -> None:
    """With the store's feed, a watcher hears a commit made behind the runner's back (another
    writer on the same store); without it, it would hear only the runner's own."""
    inner = MemoryStore(scope="shared", max_tasks=None, max_active_tasks_per_scope=None)
    counting = CountingStore(inner)
    heard: list[TaskChange] = []
    async with Runner(counting, owner_id="watcher") as runner:
        runner.watch(heard.append)
        ctx = SimpleNamespace(principal=None)
        access = await inner.authorize(ctx, Action.CREATE, "t1")
        await inner.create(new_task("t1", await inner.now(), None, 100), WORK, access)
        cancel = await inner.authorize(ctx, Action.CANCEL, "t1")
        result = await inner.transition("t1", 0, Event.cancelled(), RequestAuthority(cancel))
        assert isinstance(result, Transition)
        await trio.testing.wait_all_tasks_blocked()
    changed = [change for change in heard if change.kind == "changed"]
    assert [(change.task_id, change.revision) for change in changed] == [("t1", 1)]
    assert counting.calls["create"] == 0  # the runner made no write: it only listened


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_counting_store_still_counts_create_claimed(kind: str, tmp_path: Path) -> None:
    inner = _stores(tmp_path)[kind]
    counting = CountingStore(inner)
    async with counting:
        ctx = SimpleNamespace(principal=None)
        access = await counting.authorize(ctx, Action.CREATE, "t1")
        task = new_task("t1", await counting.now(), None, 100)
        claimed = await counting.create_claimed(task, WORK, access, "me", 10_000)
    assert claimed.lease.task_id == "t1"
    assert counting.calls["create_claimed"] == 1
    assert counting.writes == 1
