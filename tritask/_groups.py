"""Keeping a lone user exception out of an ``ExceptionGroup``.

trio's nurseries wrap every exception that crosses them in an ``ExceptionGroup`` (strict
groups). A context manager that owns a nursery (``async with Runner(store)``,
``async with app.running()``) would therefore turn a ``ValueError`` raised in the caller's own
block into a group the caller never asked for, and ``except ValueError`` would stop working.
Like trio-websocket's ``open_websocket``, such a context manager hands back the caller's
exception unwrapped when it is the only thing in the group; anything else (a failure of the
manager's own tasks) stays a group, because then there really are several errors to report.
"""

from __future__ import annotations

from collections.abc import Iterator


def leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    """The exceptions inside ``group`` and its nested groups, in order."""
    for exception in group.exceptions:
        if isinstance(exception, BaseExceptionGroup):
            yield from leaves(exception)
        else:
            yield exception


def is_lone(group: BaseExceptionGroup[BaseException], exception: BaseException | None) -> bool:
    """Whether ``group`` holds ``exception`` and nothing else (at any nesting depth)."""
    if exception is None:
        return False
    found = list(leaves(group))
    return len(found) == 1 and found[0] is exception
