"""``revise`` (check only what changes, then every invariant) and ``clone_snapshot`` (an
independent copy without re-checking): the two ways records are built inside the core."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from tritask.tasks.events import Event
from tritask.tasks.model import (
    CorruptRecord,
    Snapshot,
    TaskStatus,
    clone_snapshot,
    initial_snapshot,
    new_task,
    owned_task,
    revise,
)
from tritask.tasks.reducer import apply
from tritask.tasks.work import InvalidJSON, Work

T0 = 1_700_000_000_000_000


def waiting_snapshot() -> Snapshot:
    """A task waiting for input ``k`` (every JSON field of the record is non-empty)."""
    work = Work.tool_call("t", "tool", {"a": [1, {"b": 2}]})
    snapshot = initial_snapshot(new_task("t", T0, None, None), work)
    request = {"method": "elicitation/create", "params": {"x": [1]}}
    return apply(snapshot, Event.input_requested("k", request), T0 + 1000).snapshot


def test_revise_checks_every_invariant_of_the_result() -> None:
    task = new_task("t", T0, None, None)
    with pytest.raises(CorruptRecord, match="exactly completed tasks carry a result"):
        revise(task, status=TaskStatus.COMPLETED, status_message=None)
    with pytest.raises(CorruptRecord, match="lastUpdatedAt precedes createdAt"):
        revise(task, last_updated_at=T0 - 1)
    with pytest.raises(TypeError, match="has no fields"):
        revise(task, colour="blue")


def test_revise_checks_and_copies_the_changed_json_and_shares_the_rest() -> None:
    snapshot = waiting_snapshot()
    result = {"content": [{"type": "text", "text": "hi"}]}
    done = revise(
        snapshot.task,
        status=TaskStatus.COMPLETED,
        status_message=None,
        input_requests={},
        result=result,
        last_updated_at=T0 + 2000,
    )
    result["content"].clear()
    assert done.result == {"content": [{"type": "text", "text": "hi"}]}
    assert done.used_input_keys is snapshot.task.used_input_keys
    with pytest.raises(InvalidJSON):
        revise(done, result={"n": float("nan")})
    same = revise(snapshot, revision=snapshot.revision + 1)
    assert same.input_history is snapshot.input_history  # unchanged: shared, not re-checked
    assert same.task is snapshot.task


def test_clone_snapshot_is_equal_and_shares_no_container() -> None:
    snapshot = waiting_snapshot()
    clone = clone_snapshot(snapshot)
    assert clone == snapshot
    assert clone.work is not None and snapshot.work is not None
    clone.work.input["arguments"]["a"][1]["b"] = 3
    clone.task.input_requests["k"]["params"]["x"].append(2)
    clone.input_history["k"]["params"]["x"].append(2)
    clone.accepted_input_responses["other"] = {}
    assert snapshot == waiting_snapshot()


def test_owned_task_rechecks_a_task_mutated_after_it_was_built() -> None:
    task = new_task("t", T0, None, None)
    task.input_requests["k"] = {"method": "m"}  # a working task with a request: invalid
    with pytest.raises(CorruptRecord, match="input_required needs outstanding requests"):
        owned_task(task)


def test_clone_snapshot_copies_every_field_and_owns_every_container() -> None:
    """The copiers are generated from the attrs fields: none is left out, and every dict or
    list of the record (JSON anywhere in it) is a new object in the copy."""
    snapshot = revise(
        waiting_snapshot(), steps={"s": {"kind": "sleep", "wakeAt": "2030-03-17T17:46:40.000Z"}}
    )
    clone = clone_snapshot(snapshot)
    assert snapshot.work is not None and clone.work is not None
    pairs: list[tuple[Any, Any]] = [
        (snapshot, clone),
        (snapshot.task, clone.task),
        (snapshot.work, clone.work),
    ]
    for original, copied in pairs:
        for field in attrs.fields(type(original)):
            mine, theirs = getattr(original, field.name), getattr(copied, field.name)
            assert mine == theirs, field.name
            if isinstance(mine, dict | list) and mine:
                assert mine is not theirs, field.name
