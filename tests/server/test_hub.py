"""The listen hub: generic filter matching, bounded buffers, graceful close."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from tritask.server import App, Hub
from tritask.server.hub import HubEvent, Subscription, matches


@pytest.mark.parametrize(
    ("accepted", "selector", "expected"),
    [
        ({"toolsListChanged": True}, {"toolsListChanged": True}, True),
        ({"toolsListChanged": True}, {"promptsListChanged": True}, False),
        ({}, {"toolsListChanged": True}, False),
        ({"toolsListChanged": False}, {"toolsListChanged": True}, False),
        ({"toolsListChanged": True}, {"toolsListChanged": False}, False),
        ({"toolsListChanged": "yes"}, {"toolsListChanged": True}, False),
        ({"resourceSubscriptions": ["a", "b"]}, {"resourceSubscriptions": ["b"]}, True),
        ({"resourceSubscriptions": ["a"]}, {"resourceSubscriptions": ["c"]}, False),
        ({"resourceSubscriptions": []}, {"resourceSubscriptions": ["c"]}, False),
        ({"resourceSubscriptions": "a"}, {"resourceSubscriptions": ["a"]}, False),
        ({"resourceSubscriptions": ["a"]}, {"resourceSubscriptions": "a"}, False),
        # Extension keys need no teaching: any boolean or list key works the same way.
        ({"taskIds": ["t1", "t2"]}, {"taskIds": ["t2"]}, True),
        ({"taskIds": ["t1"]}, {"taskIds": ["t3"]}, False),
        ({"vendor/flag": True}, {"vendor/flag": True}, True),
        # One matching key of several is enough.
        (
            {"resourceSubscriptions": ["x"]},
            {"resourcesListChanged": True, "resourceSubscriptions": ["x"]},
            True,
        ),
        ({"toolsListChanged": True}, {}, False),
    ],
)
def test_matches(accepted: dict[str, Any], selector: dict[str, Any], expected: bool) -> None:
    assert matches(accepted, selector) is expected


def drain(subscription: Subscription) -> list[HubEvent]:
    events = list(subscription._events or ())
    subscription._events = None
    return events


async def test_publish_reaches_only_matching_subscribers() -> None:
    hub = Hub()
    tools = hub.open({"toolsListChanged": True})
    resources = hub.open({"resourceSubscriptions": ["demo://a"]})
    nothing = hub.open({})
    assert hub.subscriber_count == 3
    assert hub.publish("notifications/tools/list_changed", {}, {"toolsListChanged": True}) == 1
    assert (
        hub.publish(
            "notifications/resources/updated",
            {"uri": "demo://a"},
            {"resourceSubscriptions": ["demo://a"]},
        )
        == 1
    )
    assert hub.publish("x", {}, {"resourceSubscriptions": ["demo://b"]}) == 0
    assert [e.method for e in drain(tools)] == ["notifications/tools/list_changed"]
    assert drain(resources) == [
        HubEvent(
            "notifications/resources/updated",
            {"uri": "demo://a"},
            {"resourceSubscriptions": ["demo://a"]},
        )
    ]
    assert drain(nothing) == []


async def test_iteration_delivers_in_order_and_close_ends_it() -> None:
    hub = Hub()
    subscription = hub.open({"toolsListChanged": True})
    received: list[str] = []

    async def consume() -> None:
        async for event in subscription:
            received.append(event.method)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        for index in range(3):
            hub.publish(f"m{index}", {}, {"toolsListChanged": True})
        await trio.testing.wait_all_tasks_blocked()
        assert received == ["m0", "m1", "m2"]
        hub.close()
    # The consumer returned by itself: close() ended the iteration.
    assert received == ["m0", "m1", "m2"]
    assert hub.closed
    assert hub.subscriber_count == 0


async def test_close_keeps_buffered_events_then_ends() -> None:
    hub = Hub()
    subscription = hub.open({"toolsListChanged": True})
    hub.publish("a", {}, {"toolsListChanged": True})
    hub.close()
    assert [event.method async for event in subscription] == ["a"]


async def test_open_after_close_ends_at_once() -> None:
    hub = Hub()
    hub.close()
    subscription = hub.open({"toolsListChanged": True})
    assert hub.subscriber_count == 0
    assert hub.publish("a", {}, {"toolsListChanged": True}) == 0
    with trio.fail_after(1):
        assert [event async for event in subscription] == []


async def test_overflow_closes_the_slow_subscriber_only(caplog: pytest.LogCaptureFixture) -> None:
    hub = Hub(buffer_size=2)
    slow = hub.open({"toolsListChanged": True})
    fast = hub.open({"toolsListChanged": True})
    assert hub.publish("e0", {}, {"toolsListChanged": True}) == 2
    assert [e.method for e in drain(fast)] == ["e0"]
    assert hub.publish("e1", {}, {"toolsListChanged": True}) == 2
    assert [e.method for e in drain(fast)] == ["e1"]
    assert hub.publish("e2", {}, {"toolsListChanged": True}) == 1  # slow is full: closed
    assert slow.overflowed and not fast.overflowed
    assert hub.subscriber_count == 1
    assert "closing a listen stream that fell 2 events behind" in caplog.text
    # The slow subscriber sees what was buffered, then a clean end.
    with trio.fail_after(1):
        assert [event.method async for event in slow] == ["e0", "e1"]
    assert hub.publish("e3", {}, {"toolsListChanged": True}) == 1
    assert [e.method for e in drain(fast)] == ["e2", "e3"]


async def test_close_subscription_unregisters() -> None:
    hub = Hub()
    subscription = hub.open({"toolsListChanged": True})
    hub.close_subscription(subscription)
    assert hub.subscriber_count == 0
    assert hub.publish("a", {}, {"toolsListChanged": True}) == 0
    assert [event async for event in subscription] == []
    hub.close_subscription(subscription)  # idempotent


async def test_app_registrations_publish(make_app: Callable[..., App]) -> None:
    app = make_app()
    subscription = app.hub.open(
        {
            "toolsListChanged": True,
            "promptsListChanged": True,
            "resourcesListChanged": True,
            "resourceSubscriptions": ["demo://r"],
        }
    )

    async def tool() -> str:
        """A tool."""
        return ""

    async def prompt() -> str:
        return ""

    app.add_tool(tool)
    app.remove_tool("tool")
    app.remove_tool("tool")  # not registered any more: no event
    app.add_prompt(prompt)
    app.resource("demo://r")(tool)
    app.notify_resource_updated("demo://r")
    app.notify_resource_updated("demo://other")
    events = drain(subscription)
    assert [(e.method, e.params) for e in events] == [
        ("notifications/tools/list_changed", {}),
        ("notifications/tools/list_changed", {}),
        ("notifications/prompts/list_changed", {}),
        ("notifications/resources/list_changed", {}),
        ("notifications/resources/updated", {"uri": "demo://r"}),
    ]


async def test_an_idle_stream_holds_no_buffer() -> None:
    """A stream with nothing buffered keeps no deque (10,000 idle listen streams would hold
    10,000 empty deques of 624 bytes); one is made for an event and dropped once it is taken."""
    hub = Hub()
    subscription = hub.open({"toolsListChanged": True})
    assert subscription._events is None and subscription.pending == 0
    assert hub.publish("notifications/tools/list_changed", {"n": 1}, {"toolsListChanged": True})
    assert hub.publish("notifications/tools/list_changed", {"n": 2}, {"toolsListChanged": True})
    assert subscription.pending == 2
    first = await subscription.__anext__()
    assert first.params == {"n": 1} and subscription.pending == 1
    second = await subscription.__anext__()
    assert second.params == {"n": 2}
    assert subscription._events is None and subscription.pending == 0
