"""The subscription hub behind ``subscriptions/listen``.

Publishers (list changes, resource updates, the Tasks extension's status pushes) hand the hub an
event with a *selector*; each open listen stream has the *filter* it was granted. Matching is
generic, so an extension adds filter keys without teaching the hub anything: a boolean key
matches when both sides are true, a list key when the lists share an entry. Filters are indexed
by key and entry, so a publish costs what its matching subscribers cost, not one check per open
stream.

Each subscriber has a bounded buffer. An event may carry a *key*: when a subscriber's buffer is
full, its buffered events are coalesced to the latest one of each key (a task's latest state,
say), so a subscriber that falls behind keeps the newest of everything and never grows. Only
when the buffer still holds ``buffer_size`` events after coalescing (unkeyed events, or more
keys than the buffer) is the subscriber closed; the client sees a graceful end and can listen
again.

An event may also carry a *render* function, which the stream that delivers it calls with
its subscription and request context to produce the notification's params (or ``None``: send
nothing). The Tasks extension uses it to read a task through the store with the listener's own
access when the change was committed on another host.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any

import attrs
import trio

from tritask.jsonrpc import JSONValue

log = logging.getLogger("tritask.server")

Render = Callable[["Subscription", Any], Awaitable[dict[str, JSONValue] | None]]
"""``render(subscription, ctx)``: the params to send for an event, or ``None`` for nothing."""


@attrs.frozen
class HubEvent:
    method: str
    params: dict[str, JSONValue]
    selector: Mapping[str, JSONValue]
    key: Hashable | None = None
    """Events with one key coalesce to the latest in a subscriber that fell behind."""
    render: Render | None = attrs.field(default=None, eq=False, repr=False)
    """Called by the delivering stream to build the params (``params`` is then unused)."""


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


def _hashable(item: object) -> bool:
    return isinstance(item, (str, int, float)) or item is None


@attrs.define(eq=False)
class Subscription:
    """One open listen stream: iterate it to receive matching events.

    ``state`` is the stream's own scratch space for extensions (keyed by extension id), e.g.
    the revision of each task a stream has already sent.
    """

    accepted: dict[str, JSONValue]
    limit: int = 256
    live: bool = False
    overflowed: bool = False
    state: dict[str, Any] = attrs.field(factory=dict)
    _events: collections.deque[HubEvent] | None = attrs.field(default=None, init=False)
    """Buffered events, ``None`` while there are none: an empty deque takes 624 bytes, and
    most of the time most streams have nothing buffered."""
    _wake: Callable[[], None] | None = attrs.field(default=None, init=False)
    """Called once when an event is buffered or the stream ends: the iterating task's
    ``Event.set``, or the waker of whoever drives the stream (:meth:`set_waker`)."""
    _ended: bool = attrs.field(default=False, init=False)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> HubEvent:
        if self._events:
            await trio.lowlevel.checkpoint()  # a checkpoint either way, as a channel is
        while not self._events:
            if self._ended:
                raise StopAsyncIteration
            await self.wait()
        event = self.take()
        assert event is not None
        return event

    async def wait(self) -> None:
        """Park until :attr:`ready` (returns at once, without a checkpoint, if it is)."""
        if self.ready:
            return
        event = trio.Event()
        self._wake = event.set
        try:
            await event.wait()
        finally:
            if self._wake == event.set:
                self._wake = None

    @property
    def ready(self) -> bool:
        """An event is buffered, or the stream has ended: taking it does not wait."""
        return bool(self._events) or self._ended

    def take(self) -> HubEvent | None:
        """The oldest buffered event, without waiting (``None``: nothing is buffered)."""
        events = self._events
        if not events:
            return None
        event = events.popleft()
        if not events:
            self._events = None
        return event

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """Have ``wake`` called (once) when the stream becomes :attr:`ready`; at once if it
        already is. ``None`` removes it. This lets a task that waits on something else too
        (a transport's socket) learn of events without a task of the stream's own."""
        self._wake = wake
        if wake is not None and self.ready:
            self._notify()

    def push(
        self,
        method: str,
        params: dict[str, JSONValue],
        *,
        key: Hashable | None = None,
        render: Render | None = None,
    ) -> bool:
        """Deliver one event to this stream alone (``False`` if it has ended or overflowed)."""
        return self._put(HubEvent(method, params, {}, key, render))

    @property
    def pending(self) -> int:
        """Events buffered and not yet taken."""
        return len(self._events) if self._events is not None else 0

    @property
    def ended(self) -> bool:
        return self._ended

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake()

    def _end(self) -> None:
        self._ended = True
        self._notify()

    def _put(self, event: HubEvent) -> bool:
        """Buffer ``event`` (coalescing when full); ``False`` when this subscriber overflowed."""
        if self._ended:
            return False
        if self._events is not None and len(self._events) >= self.limit:
            self._coalesce(event.key)
            if self._events is not None and len(self._events) >= self.limit:
                self.overflowed = True
                self._end()
                return False
        if self._events is None:
            self._events = collections.deque()
        self._events.append(event)
        self._notify()
        return True

    def _coalesce(self, incoming: Hashable | None) -> None:
        """Keep the latest buffered event of each key (unkeyed ones all), in order; drop the
        one with ``incoming``'s key too, since the incoming event supersedes it."""
        latest: dict[Hashable, int] = {}
        buffered = list(self._events or ())
        for index, event in enumerate(buffered):
            if event.key is not None:
                latest[event.key] = index
        kept = [
            event
            for index, event in enumerate(buffered)
            if event.key is None or (latest[event.key] == index and event.key != incoming)
        ]
        self._events = collections.deque(kept) if kept else None


@attrs.define(eq=False)
class Hub:
    buffer_size: int = 256
    _subscriptions: set[Subscription] = attrs.field(factory=set, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    # key -> subscribers granted ``True``; key -> entry -> subscribers granted a list with it.
    _flags: dict[str, set[Subscription]] = attrs.field(factory=dict, init=False)
    _entries: dict[str, dict[Any, set[Subscription]]] = attrs.field(factory=dict, init=False)
    # Matched by scanning: live filters, and filters with entries that cannot be indexed.
    _scanned: set[Subscription] = attrs.field(factory=set, init=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def open(self, accepted: dict[str, JSONValue], *, live: bool = False) -> Subscription:
        """Open a stream with the filter ``accepted``.

        With ``live`` the filter's lists may change after opening (a legacy session's resource
        subscriptions): the stream is matched by scanning instead of through the index.
        """
        subscription = Subscription(accepted, self.buffer_size, live)
        if self._closed:
            subscription._end()
        else:
            self._subscriptions.add(subscription)
            self._index(subscription)
        return subscription

    def _index(self, subscription: Subscription) -> None:
        if subscription.live:
            self._scanned.add(subscription)
            return
        for key, granted in subscription.accepted.items():
            if granted is True:
                self._flags.setdefault(key, set()).add(subscription)
            elif isinstance(granted, list):
                if not all(_hashable(item) for item in granted):
                    self._scanned.add(subscription)
                    continue
                by_entry = self._entries.setdefault(key, {})
                for item in granted:
                    by_entry.setdefault(item, set()).add(subscription)

    def _unindex(self, subscription: Subscription) -> None:
        self._scanned.discard(subscription)
        for key, granted in subscription.accepted.items():
            if granted is True:
                self._drop(self._flags, key, subscription)
            elif isinstance(granted, list):
                by_entry = self._entries.get(key)
                if by_entry is None:
                    continue
                for item in granted:
                    if _hashable(item):
                        self._drop(by_entry, item, subscription)
                if not by_entry:
                    del self._entries[key]

    @staticmethod
    def _drop(index: dict[Any, set[Subscription]], key: Any, subscription: Subscription) -> None:
        members = index.get(key)
        if members is not None:
            members.discard(subscription)
            if not members:
                del index[key]

    def close_subscription(self, subscription: Subscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.discard(subscription)
            self._unindex(subscription)
        subscription._events = None
        subscription._end()

    def forget(self, subscription: Subscription, key: str, entry: JSONValue) -> None:
        """Take ``entry`` out of ``subscription``'s list filter ``key`` (a watched task is
        gone). A stream left with nothing to listen for ends after what it has buffered."""
        granted = subscription.accepted.get(key)
        if not isinstance(granted, list) or entry not in granted:
            return
        registered = subscription in self._subscriptions
        if registered:
            self._unindex(subscription)
        remaining = [item for item in granted if item != entry]
        if remaining:
            subscription.accepted[key] = remaining
        else:
            del subscription.accepted[key]
        if not registered:
            return
        if any(
            value is True or (isinstance(value, list) and value)
            for value in subscription.accepted.values()
        ):
            self._index(subscription)
        else:
            self._subscriptions.discard(subscription)
            subscription._end()

    def _candidates(self, selector: Mapping[str, JSONValue]) -> Iterable[Subscription]:
        found: set[Subscription] = set()
        for key, wanted in selector.items():
            if wanted is True:
                found.update(self._flags.get(key, ()))
            elif isinstance(wanted, list):
                by_entry = self._entries.get(key)
                if by_entry is None:
                    continue
                for item in wanted:
                    if _hashable(item):
                        found.update(by_entry.get(item, ()))
                    else:  # an entry no index holds: every list subscriber of the key may match
                        found.update(s for s in self._subscriptions if key in s.accepted)
        if self._scanned:
            found.update(s for s in self._scanned if matches(s.accepted, selector))
        return found

    def publish(
        self,
        method: str,
        params: dict[str, JSONValue],
        selector: dict[str, Any],
        *,
        key: Hashable | None = None,
        render: Render | None = None,
    ) -> int:
        """Deliver to every matching subscriber without blocking; returns how many got it."""
        if not self._subscriptions:
            return 0
        event = HubEvent(method, params, selector, key, render)
        delivered = 0
        for subscription in self._candidates(selector):
            if subscription._put(event):
                delivered += 1
            elif subscription.overflowed:
                log.warning("closing a listen stream that fell %d events behind", self.buffer_size)
                self._subscriptions.discard(subscription)
                self._unindex(subscription)
        return delivered

    def entries(self, key: str) -> list[Any]:
        """Every entry of list filter ``key`` that an open stream holds (e.g. watched tasks)."""
        found = set(self._entries.get(key, ()))
        for subscription in self._scanned:
            granted = subscription.accepted.get(key)
            if isinstance(granted, list):
                found.update(item for item in granted if _hashable(item))
        return list(found)

    def close(self) -> None:
        """Graceful shutdown: every stream ends with its final result."""
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription._end()
        self._subscriptions.clear()
        self._flags.clear()
        self._entries.clear()
        self._scanned.clear()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscriptions)
