"""Durable steps: the errors a step can raise, its options and its argument fingerprint.

``await ctx.step(key, fn, *args, **kwargs)`` runs ``fn`` and commits its JSON result (or a
terminal :class:`StepFailed`) to the store under the attempt's lease before it returns; every
later attempt of the task gets the recorded outcome for ``key`` without running ``fn``. The
runner implements it (``Runner._step``); this module holds what tools and executors see.

Each step runs at least once; its recording happens exactly once. A crash between a step's side
effect and its commit runs the body again on the next attempt, so hand ``ctx.step_key(key)``
(stable across attempts) to external APIs as their idempotency key, or opt into
``semantics="at_most_once"`` and reconcile on :class:`StepInterrupted`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, Final, Literal

from tritask.tasks.events import MAX_STEP_KEY_CHARS, is_step_error
from tritask.tasks.work import InvalidJSON, JSONObject, canonical_json, ensure_json

__all__ = [
    "DuplicateStepKey",
    "Semantics",
    "StepError",
    "StepFailed",
    "StepInterrupted",
    "StepMismatch",
    "StepMisuse",
    "StepTooLarge",
    "check_step_key",
    "check_step_options",
    "only_step_errors",
    "step_fingerprint",
]

Semantics = Literal["at_least_once", "at_most_once"]
MAX_STEP_RETRY_DELAY_MS: Final = 3_600_000
"""The longest delay of a step's in-attempt retry list (longer backoff: the task's retries)."""


class StepError(Exception):
    """A step problem that fails the task (never retried): its JSON-RPC error is
    :meth:`to_error`."""

    code = -32603

    def to_error(self) -> JSONObject:
        return {"code": self.code, "message": str(self)}


class StepFailed(StepError):
    """A terminal step failure: raise it inside a step body to record it as the step's outcome.

    Every later attempt gets the same error raised again for that key (the body does not run).
    Left uncaught by the tool, it fails the task with this JSON-RPC error.
    """

    def __init__(
        self, message: str, *, code: int = -32603, data: Any = None, key: str | None = None
    ) -> None:
        if not isinstance(message, str):
            raise TypeError("a StepFailed message must be a string")
        if type(code) is not int:
            raise TypeError("a StepFailed code must be an int")
        super().__init__(message)
        self.message = message
        self.code = code
        self.data = None if data is None else ensure_json(data, what="StepFailed data")
        self.key = key

    @property
    def error(self) -> JSONObject:
        """The JSON-RPC error recorded for the step: ``{code, message, data?}``."""
        error: JSONObject = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error

    def to_error(self) -> JSONObject:
        return self.error

    @classmethod
    def from_error(cls, error: JSONObject, key: str | None = None) -> StepFailed:
        if not is_step_error(error):
            raise ValueError("not a recorded step error")
        return cls(error["message"], code=error["code"], data=error.get("data"), key=key)


class StepMismatch(StepError):
    """A recorded step is replayed with other arguments (or as another kind): the task fails,
    naming the key and both fingerprints."""

    def __init__(self, key: str, recorded: str, given: str) -> None:
        super().__init__(
            f"step {key!r} was recorded with fingerprint {recorded} but is replayed with "
            f"{given}: the task's code or arguments changed (pass fingerprint= to pin it)"
        )
        self.key = key
        self.recorded = recorded
        self.given = given


class StepInterrupted(StepError):
    """An ``at_most_once`` step started in an earlier attempt and has no outcome: its body may
    or may not have run. Catch it to reconcile (look the effect up, then go on or fail)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"step {key!r} (at_most_once) started in an earlier attempt that ended before "
            "recording its outcome; its effect is unknown"
        )
        self.key = key


class DuplicateStepKey(StepError):
    """A step, sleep or input key was used twice in one attempt (keys are unique per task)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"step key {key!r} is used twice in one attempt of this task")
        self.key = key


class StepTooLarge(StepError):
    """A step outcome is not JSON or passes a limit (64 KiB per outcome, 1 MiB and 1,000 keys
    per task): nothing is recorded, and the task fails at once (retrying cannot help)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"step {key!r}: {reason}")
        self.key = key


class StepMisuse(StepError):
    """``ctx.step``, ``ctx.sleep`` or ``ctx.await_input`` inside a step body, or a step outside a
    running attempt's tool."""


def check_step_key(key: object) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_STEP_KEY_CHARS:
        raise ValueError(f"a step key must be a string of 1..{MAX_STEP_KEY_CHARS} characters")
    return key


def step_fingerprint(key: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of the step's arguments.

    Arguments that are not JSON raise ``TypeError``: pass ``fingerprint=`` (any string that
    identifies them) instead of letting an unstable key decide.
    """
    try:
        text = canonical_json({"args": list(args), "kwargs": kwargs})
    except InvalidJSON as exc:
        raise TypeError(
            f"step {key!r}: its arguments are not JSON ({exc}); pass fingerprint= to name them"
        ) from None
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_step_options(
    timeout_s: float | None, retry: Sequence[int], semantics: str
) -> tuple[float | None, tuple[int, ...]]:
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError("timeout_s must be a positive number of seconds or None")
    if isinstance(retry, str | bytes):
        raise TypeError("retry must be a sequence of delays in milliseconds")
    delays = tuple(retry)
    if not all(
        type(d) is int and 0 <= d <= MAX_STEP_RETRY_DELAY_MS for d in delays
    ):  # pragma: no branch
        raise ValueError(
            f"retry delays must be ints of milliseconds in 0..{MAX_STEP_RETRY_DELAY_MS}"
        )
    if semantics not in ("at_least_once", "at_most_once"):
        raise ValueError("semantics must be 'at_least_once' or 'at_most_once'")
    return timeout_s, delays


def only_step_errors(group: BaseExceptionGroup[BaseException]) -> StepError | None:
    """The first :class:`StepError` of a group that holds nothing else (steps a tool ran in a
    nursery), else ``None``: such a group fails the task with that step's own error."""
    step_errors, rest = group.split(StepError)
    if step_errors is None or rest is not None:
        return None
    first: BaseException = step_errors
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first if isinstance(first, StepError) else None
