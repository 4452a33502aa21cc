"""Instrumentation: exact job and transition event sequences, and no payload ever leaks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing
from helpers import ELICIT_CAPS, START_US, Env, all_strings, start_env, wait_stops

from tritask.server.context import Context
from tritask.server.mrtr import elicitation
from tritask.tasks import TrioClock
from tritask.tasks import instrumentation as ins
from tritask.tasks.executor import Completed, ExecutionToken
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-extension-lifecycle")

CORE = (ins.JOB_START, ins.STORE_TRANSITION, ins.JOB_STOP)


class Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"task-{self.n}"


async def _env(nursery: trio.Nursery, **kw: Any) -> Env:
    env = await start_env(
        nursery,
        task_support={"work": "required", "block": "required", "ask": "required"},
        tasks_options={"id_generator": Ids()},
        **kw,
    )

    @env.app.tool()
    async def work(payload: str = "", seconds: float = 2.0, crash: bool = False) -> str:
        """Sleeps, then returns (or crashes with) the payload."""
        await trio.sleep(seconds)
        if crash:
            raise RuntimeError(f"crash {payload}")
        return f"result {payload}"

    @env.app.tool()
    async def block() -> str:
        """Waits until cancelled."""
        await trio.sleep_forever()

    @env.app.tool()
    async def ask(ctx: Context, payload: str = "") -> str:
        """Asks for input carrying the payload."""
        answer = await ctx.await_input("q", elicitation(f"question {payload}", {"type": "object"}))
        return f"answered {answer}"

    return env


def _core(env: Env, task_id: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        (name, measurements, metadata)
        for name, measurements, metadata in env.events.events
        if name in CORE and metadata.get("task_id") == task_id
    ]


async def test_a_completed_job_emits_start_transition_stop(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _env(nursery)
    await trio.sleep(3)
    task_id = await env.create("work")
    await env.wait_status(task_id, "completed")
    await wait_stops(env.events, task_id)
    events = _core(env, task_id)
    assert [name for name, _, _ in events] == list(CORE)
    (_, start_m, start_md), (_, tr_m, tr_md), (_, stop_m, stop_md) = events
    assert start_m == {"jobs": 1, "system_time": 3.0}
    assert start_md == {"task_id": task_id, "revision": 0, "source": "request", "tool": "work"}
    assert set(tr_m) == {"duration"}
    assert tr_md == {
        "task_id": task_id,
        "expected_revision": 0,
        "event_kind": "completed",
        "authority": "worker",
        "outcome": "applied",
        "settle": True,
    }
    assert stop_m == {"duration": 2.0, "jobs": 0}
    assert stop_md == {
        "task_id": task_id,
        "outcome": "completed",
        "store_outcome": "applied",
        "release_outcome": "ok",
        "source": "request",
        "tool": "work",
    }
    assert stop_m["duration"] >= tr_m["duration"]
    # Around them the creation and the lease bookkeeping, in order: the claim comes first.
    names = [name for name, _, md in env.events.events if md.get("task_id") == task_id]
    assert names == [ins.LEASE_CLAIMED, ins.JOB_START, ins.TASK_CREATED, *CORE[1:]]
    assert env.named(ins.LEASE_CLAIMED)[0] == (
        {"generation": 1, "duration": 0.0},  # the memory store answers without waiting
        {"task_id": task_id, "source": "request"},
    )
    assert env.named(ins.TASK_CREATED)[0] == (
        {"duration": 0.0},
        {"task_id": task_id, "tool": "work", "outcome": "created"},
    )
    assert {name for name, _, _ in env.events.events} <= ins.EVENT_NAMES


async def test_a_cancellation_emits_the_request_transition_then_stop(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _env(nursery)
    task_id = await env.create("block")
    await trio.sleep(1)
    await env.result("tasks/cancel", {"taskId": task_id})
    events = _core(env, task_id)
    assert [(name, md) for name, _, md in events] == [
        (
            ins.JOB_START,
            {"task_id": task_id, "revision": 0, "source": "request", "tool": "block"},
        ),
        (
            ins.STORE_TRANSITION,
            {
                "task_id": task_id,
                "expected_revision": 0,
                "event_kind": "cancelled",
                "authority": "request",
                "outcome": "applied",
                "settle": False,
            },
        ),
        (
            ins.JOB_STOP,
            {
                "task_id": task_id,
                "outcome": "cancelled",
                "store_outcome": "not_settled",
                "release_outcome": "ok",
                "source": "request",
                "tool": "block",
            },
        ),
    ]
    assert events[2][1] == {"duration": 1.0, "jobs": 0}
    # A second cancel is a visible, unchanged no-op.
    await env.result("tasks/cancel", {"taskId": task_id})
    last = env.named(ins.STORE_TRANSITION)[-1][1]
    assert (last["event_kind"], last["authority"], last["outcome"]) == (
        "cancelled",
        "request",
        "unchanged",
    )


async def test_input_and_failure_transitions_are_instrumented(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _env(nursery)
    asked = await env.create("ask", caps=ELICIT_CAPS)
    await env.wait_status(asked, "input_required")
    update = {"taskId": asked, "inputResponses": {"q": {"action": "accept"}}}
    await env.result("tasks/update", update)
    await env.wait_status(asked, "completed")
    await wait_stops(env.events, asked)
    kinds = [
        (md["event_kind"], md["authority"], md["expected_revision"], md["outcome"])
        for _, md in env.named(ins.STORE_TRANSITION)
        if md["task_id"] == asked
    ]
    assert kinds == [
        ("input_requested", "worker", 0, "applied"),
        ("input_responses_accepted", "request", 1, "applied"),
        ("completed", "worker", 2, "applied"),
    ]
    crashed = await env.create("work", {"crash": True})
    await env.wait_status(crashed, "failed")
    (stop,) = await wait_stops(env.events, crashed)
    assert (stop["outcome"], stop["store_outcome"]) == ("failed", "applied")


async def test_no_payload_ever_reaches_an_event(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _env(nursery)
    secret = "SECRET-PAYLOAD-7f3a"
    done = await env.create("work", {"payload": f"{secret}-argument"})
    crashed = await env.create("work", {"payload": f"{secret}-crash", "crash": True})
    asked = await env.create("ask", {"payload": f"{secret}-question"}, caps=ELICIT_CAPS)
    await env.wait_status(asked, "input_required")
    answer = {"action": "accept", "content": {"value": f"{secret}-answer"}}
    await env.result("tasks/update", {"taskId": asked, "inputResponses": {"q": answer}})
    blocked = await env.create("block")
    await env.result("tasks/cancel", {"taskId": blocked})
    for task_id, status in ((done, "completed"), (crashed, "failed"), (asked, "completed")):
        detail = await env.wait_status(task_id, status)
        if status == "completed":
            assert secret in str(detail["result"])  # the payload exists, just not in events
    for task_id in (done, crashed, asked, blocked):
        await wait_stops(env.events, task_id)
    assert len(env.events.events) >= 16
    for name, measurements, metadata in env.events.events:
        assert name in ins.EVENT_NAMES
        for value in measurements.values():
            assert isinstance(value, int | float)
        for text in all_strings(metadata):
            assert secret not in text, (name, metadata)
        assert set(metadata) <= {
            "task_id",
            "revision",
            "source",
            "expected_revision",
            "event_kind",
            "authority",
            "outcome",
            "store_outcome",
            "release_outcome",
            "settle",
            "tool",
        }


class ExplodingSink:
    def __init__(self) -> None:
        self.calls = 0

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        self.calls += 1
        raise RuntimeError("sink is broken")


async def test_a_failing_sink_never_breaks_execution(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: Any
) -> None:
    sink = ExplodingSink()
    env = await _env(nursery, runner_options={"instrumentation": sink})
    task_id = await env.create("work", {"seconds": 1})
    detail = await env.wait_status(task_id, "completed")
    assert detail["result"]["content"] == [{"type": "text", "text": "result "}]
    assert sink.calls >= 4
    assert "instrumentation sink failed" in caplog.text


class SlowAnswerStore(MemoryStore):
    """Commits a settle at once, then answers only when let go, whatever cancels the caller:
    as a database that committed before an interrupt landed returns its result."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.committed = trio.Event()
        self.answer = trio.Event()

    async def settle(self, *args: Any, **kwargs: Any) -> Any:
        result = await super().settle(*args, **kwargs)
        self.committed.set()
        with trio.CancelScope(shield=True):
            await self.answer.wait()
        return result


async def test_an_attempt_settled_while_the_runner_stops_reports_its_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = SlowAnswerStore(scope="shared", clock=TrioClock(START_US))
    events = RecordingInstrumentation()

    class Done:
        async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
            return Completed({"content": []})

    runner = Runner(store, executor=Done(), instrumentation=events, reap_interval_ms=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        access = await store.authorize(None, Action.CREATE, "task-1")
        await runner.create_task(
            new_task("task-1", START_US, None, None),
            Work(idempotency_key="task-1", type="job", input={}),
            access,
        )
        await store.committed.wait()
        runner.stop()  # while the settle's answer is on its way
        await trio.sleep(1)
        store.answer.set()
    (stop,) = [md for _, md in events.named(ins.JOB_STOP)]
    assert (stop["outcome"], stop["store_outcome"]) == ("completed", "applied")
