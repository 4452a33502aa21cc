"""A lone exception raised in ``async with Runner(...)`` / ``app.running()`` comes out unwrapped.

Both context managers own nurseries, which wrap whatever crosses them in an ``ExceptionGroup``;
the caller's own exception must still be catchable as itself, with its traceback and cause.
A failure of the manager's own machinery beside it stays a group.
"""

from __future__ import annotations

import pytest
import trio

from tritask import App, MemoryStore, Runner, Tasks
from tritask._groups import is_lone


class Boom(Exception):
    pass


async def test_runner_context_hands_back_the_callers_exception() -> None:
    store = MemoryStore(scope="shared")
    async with store:
        with pytest.raises(Boom) as caught:
            async with Runner(store):
                try:
                    raise KeyError("cause")
                except KeyError as cause:
                    raise Boom("mine") from cause
    assert type(caught.value) is Boom
    assert isinstance(caught.value.__cause__, KeyError)
    assert caught.traceback[-1].name == "test_runner_context_hands_back_the_callers_exception"


async def test_app_running_hands_back_the_callers_exception() -> None:
    app = App("unwrap", "1.0.0")

    @app.tool
    async def noop() -> str:
        """Nothing."""
        return ""

    app.add_extension(Tasks(task_support={"noop": "optional"}))
    with pytest.raises(Boom) as caught:
        async with app.running():
            raise Boom("mine")
    assert type(caught.value) is Boom
    assert str(caught.value) == "mine"


async def test_cancellation_still_propagates_through_both() -> None:
    store = MemoryStore(scope="shared")
    app = App("unwrap", "1.0.0")
    with trio.move_on_after(0.01) as scope:
        async with store, Runner(store), app.running():
            await trio.sleep_forever()
    assert scope.cancelled_caught


def test_is_lone_looks_through_nesting_and_refuses_company() -> None:
    mine = Boom("mine")
    other = ValueError("other")
    assert is_lone(ExceptionGroup("outer", [ExceptionGroup("inner", [mine])]), mine)
    assert not is_lone(ExceptionGroup("outer", [mine, other]), mine)
    assert not is_lone(ExceptionGroup("outer", [other]), mine)
    assert not is_lone(ExceptionGroup("outer", [mine]), None)
