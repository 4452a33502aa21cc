"""The attempt's lease lock (``_LeaseGuard``) keeps ``trio.Lock``'s rules without its cost."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tritask.tasks.runner import _LeaseGuard


async def test_holding_it_twice_is_refused_not_a_hang() -> None:
    guard = _LeaseGuard()
    async with guard:
        with pytest.raises(RuntimeError, match="re-acquire"):
            await guard.__aenter__()
        assert guard.locked()
    assert not guard.locked()


async def test_waiters_get_it_in_arrival_order_and_a_cancelled_waiter_is_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    guard = _LeaseGuard()
    order: list[str] = []
    scopes: dict[str, trio.CancelScope] = {}

    async def take(name: str) -> None:
        with trio.CancelScope() as scope:
            scopes[name] = scope
            async with guard:
                order.append(name)
                await trio.sleep(1)
            return
        order.append(f"{name} cancelled")

    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c", "d"):
            nursery.start_soon(take, name)
            await trio.testing.wait_all_tasks_blocked()
        assert order == ["a"]
        scopes["c"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["a", "c cancelled"]
    assert order == ["a", "c cancelled", "b", "d"]
    assert not guard.locked()


async def test_a_cancelled_acquisition_does_not_take_a_free_lock() -> None:
    guard = _LeaseGuard()
    with trio.CancelScope() as scope:
        scope.cancel()
        async with guard:
            pytest.fail("entered a lock while cancelled")
    assert not guard.locked()


async def test_a_holder_waiting_for_a_batch_releases_it_when_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    guard = _LeaseGuard()
    guard.batch = trio.Event()
    with trio.move_on_after(1):
        async with guard:
            pytest.fail("entered before the batch ended")
    assert not guard.locked()
    guard.batch = None
    async with guard:
        assert guard.locked()
