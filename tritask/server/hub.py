"""The subscription hub behind ``subscriptions/listen``.

Publishers (list changes, resource updates, the Tasks extension's status pushes) hand the hub an
event with a *selector*; each open listen stream has the *filter* it was granted. Matching is
generic, so an extension adds filter keys without teaching the hub anything: a boolean key
matches when both sides are true, a list key when the lists share an entry.

Each subscriber has a bounded buffer. A subscriber that falls behind is closed rather than
allowed to grow without limit; the client sees a graceful end and can listen again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from tritask.jsonrpc import JSONValue

log = logging.getLogger("tritask.server")


@attrs.frozen
class HubEvent:
    method: str
    params: dict[str, JSONValue]
    selector: Mapping[str, JSONValue]


def matches(accepted: Mapping[str, JSONValue], selector: Mapping[str, JSONValue]) -> bool:
    for key, wanted in selector.items():
        granted = accepted.get(key)
        if isinstance(wanted, bool) and wanted and granted is True:
            return True
        if (
            isinstance(wanted, list)
            and isinstance(granted, list)
            and any(item in granted for item in wanted)
        ):
            return True
    return False


@attrs.define(eq=False)
class Subscription:
    """One open listen stream: iterate it to receive matching events."""

    accepted: dict[str, JSONValue]
    _send: trio.MemorySendChannel[HubEvent]
    _receive: trio.MemoryReceiveChannel[HubEvent]
    overflowed: bool = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> HubEvent:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None


@attrs.define(eq=False)
class Hub:
    buffer_size: int = 256
    _subscriptions: set[Subscription] = attrs.field(factory=set, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def open(self, accepted: dict[str, JSONValue]) -> Subscription:
        send, receive = trio.open_memory_channel[HubEvent](self.buffer_size)
        subscription = Subscription(accepted, send, receive)
        if self._closed:
            send.close()
        else:
            self._subscriptions.add(subscription)
        return subscription

    def close_subscription(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)
        subscription._send.close()
        subscription._receive.close()

    def publish(self, method: str, params: dict[str, JSONValue], selector: dict[str, Any]) -> int:
        """Deliver to every matching subscriber without blocking; returns how many got it."""
        event = HubEvent(method, params, selector)
        delivered = 0
        for subscription in list(self._subscriptions):
            if not matches(subscription.accepted, selector):
                continue
            try:
                subscription._send.send_nowait(event)
                delivered += 1
            except trio.WouldBlock:
                log.warning("closing a listen stream that fell %d events behind", self.buffer_size)
                subscription.overflowed = True
                self._subscriptions.discard(subscription)
                subscription._send.close()
            except trio.ClosedResourceError:
                self._subscriptions.discard(subscription)
        return delivered

    def close(self) -> None:
        """Graceful shutdown: every stream ends with its final result."""
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription._send.close()
        self._subscriptions.clear()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscriptions)
