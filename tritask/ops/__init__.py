"""Operator commands: ``tritask tasks list|show|cancel|stats`` and ``tritask reap``.

They work offline, on a store URL, through the store's optional operator capability
(:class:`~tritask.tasks.store.ListsTasks`): nothing here is reachable over MCP, and nothing
writes a row behind the store's back (a cancellation is the same transition a client's
``tasks/cancel`` commits).
"""
