"""An open ``subscriptions/listen`` stream, once its opening is done: what lives for hours.

A listen request is served in two parts. The *opening* (the granted filter, the hub
subscription, the acknowledgement, the extensions' snapshots) runs in the request's handler,
with everything the request brought (its params, headers, scope). What follows may last hours,
so it is a small object of its own, :class:`ListenStream`: the hub subscription, the
subscription-id tag and the listener's access (the request's context detached, as a task
worker's is). Whoever delivers it asks it for the next notification message when it is
:attr:`~ListenStream.ready`.

Two ways to deliver it. A transport that can drive a stream from a task it already has takes it
over (:meth:`Context.hand_off <tritask.server.context.Context.hand_off>`): tritask's HTTP
server runs a handed-off stream in the connection's own task, which also watches the socket for
the client going away, so an idle stream costs one trio task and no request frames. Every other
transport (stdio, WebSocket, HTTP under another ASGI server) lets the handler deliver it in the
request's own task (:meth:`ListenStream.run`). The notifications, their order and the bounded
buffer are the same either way: they are the hub subscription's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from tritask.jsonrpc import JSONValue, notification_message
from tritask.server.hub import Hub, Subscription
from tritask.server.session import Emit

log = logging.getLogger("tritask.server")

__all__ = ["ListenStream", "PushStream"]


class PushStream(Protocol):
    """A long-lived stream of notifications a handler hands to its transport.

    The transport that takes it (``Context.hand_off`` returned ``True``) owns it: it sends
    what :meth:`next_message` gives while :attr:`ready`, sends the request's response once
    :attr:`ended`, and calls :meth:`close` exactly once when it stops, whether the stream
    ended, the client went away or the transport was cancelled.
    """

    @property
    def ready(self) -> bool:
        """:meth:`next_message` has something to give, or the stream has ended."""
        ...

    @property
    def ended(self) -> bool:
        """Nothing more will come: the response may be sent."""
        ...

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """Have ``wake`` called once when :attr:`ready` becomes true (at once if it is)."""
        ...

    async def next_message(self) -> dict[str, JSONValue] | None:
        """The next notification message, or ``None`` when an event turned out to need none."""
        ...

    def close(self) -> None:
        """Release what the stream holds (its hub subscription); idempotent."""
        ...


@attrs.define(eq=False)
class ListenStream:
    """The delivery part of one listen stream (see the module docstring)."""

    hub: Hub
    subscription: Subscription
    tag: dict[str, JSONValue]
    """``_meta`` every notification of the stream carries (its subscription id)."""
    listener: object
    """The context events are rendered with (``render(subscription, listener)``): the request's
    context detached, so the stream keeps who listens and nothing of the request itself."""

    @property
    def ready(self) -> bool:
        return self.subscription.ready

    @property
    def ended(self) -> bool:
        return self.subscription.ended and not self.subscription.pending

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        self.subscription.set_waker(wake)

    async def next_message(self) -> dict[str, JSONValue] | None:
        """The next buffered event as a notification message (``None``: nothing buffered, or
        the event's render decided this stream gets nothing). Raises what rendering raises."""
        event = self.subscription.take()
        if event is None:
            return None
        method = event.method
        if event.render is not None:
            render = event.render
            del event  # an event may carry a task's state: hold none of it while rendering
            rendered = await render(self.subscription, self.listener)
            if rendered is None:
                return None
            params = dict(rendered)
        else:
            params = dict(event.params)
        event_meta = params.get("_meta")
        merged = dict(event_meta) if isinstance(event_meta, dict) else {}
        merged.update(self.tag)
        params["_meta"] = merged
        return notification_message(method, params)

    async def run(self, emit: Emit | None) -> None:
        """Deliver the stream in this task until it ends (the handler's own delivery, where
        the transport did not take it over); closes it however this returns."""
        try:
            while True:
                if self.subscription.ready:
                    await trio.lowlevel.checkpoint()  # a checkpoint each event, as a channel
                else:
                    await self.subscription.wait()
                if self.ended:
                    return
                message = await self.next_message()
                if message is not None and emit is not None:
                    await emit(message)
                del message  # an idle stream holds nothing of what it sent
        finally:
            self.close()

    def close(self) -> None:
        self.hub.close_subscription(self.subscription)
