"""Operator commands on a memory store, in process, under MockClock: every command, exact output.

A memory store lives in the process that made it, so it is operated there: ``run_on_store``
runs the same commands the ``tritask tasks`` CLI runs, on the serving app's own store, while
its runner executes real tool calls.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from tritask.jsonrpc import JSONValue
from tritask.ops import operations as ops
from tritask.ops.parser import parse_duration_ms, run_on_store
from tritask.server.app import App
from tritask.server.context import Context
from tritask.tasks import TrioClock, format_instant, parse_instant
from tritask.tasks import instrumentation as ins
from tritask.tasks.extension import Tasks
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import NOT_FOUND, Action, Store, TaskQuery, lists_tasks
from tritask.tasks.work import Work
from tritask.testing.client import Client, ClientError

START = parse_instant("2026-08-24T10:00:00.000Z")
LEASE_MS = 30_000


def at(seconds: float) -> str:
    return format_instant(START + round(seconds * 1_000_000))


@attrs.define
class Env:
    app: App
    store: MemoryStore
    runner: Runner
    events: RecordingInstrumentation
    alice: Client
    bob: Client
    cancelled: dict[str, float] = attrs.field(factory=dict)
    """Tool invocations that saw their cancellation, with trio's time when they did."""
    stopped: dict[str, trio.Event] = attrs.field(factory=lambda: defaultdict(trio.Event))


def principal_of(ctx: Any) -> JSONValue:
    principal: JSONValue = ctx.principal
    return principal


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[Env]:
    store = MemoryStore(scope=principal_of, clock=TrioClock(START))
    events = RecordingInstrumentation()
    runner = Runner(
        store,
        lease_ms=LEASE_MS,
        reap_interval_ms=None,
        max_runtime_ms=None,
        instrumentation=events,
        owner_id="runner-1",
    )
    tasks = Tasks(
        store=store,
        runner=runner,
        task_support={"hold": "required", "ask": "required", "quick": "required"},
    )
    app = App("ops-test", "0.0.1", extensions=[tasks])
    env = Env(
        app=app,
        store=store,
        runner=runner,
        events=events,
        alice=Client.direct(app, principal="alice", capabilities={"elicitation": {}}),
        bob=Client.direct(app, principal="bob", capabilities={"elicitation": {}}),
    )

    @app.tool()
    async def hold(ctx: Context, label: str) -> str:
        """Runs until it is cancelled."""
        try:
            await trio.sleep(10**9)
        finally:
            assert ctx.task_id is not None
            env.cancelled[ctx.task_id] = trio.current_time()
            env.stopped[ctx.task_id].set()
        return label

    @app.tool()
    async def ask(ctx: Context, question: str) -> str:
        """Waits for a confirmation."""
        answer = await ctx.await_input(
            "confirm",
            {"method": "elicitation/create", "params": {"message": question, "mode": "form"}},
        )
        return json.dumps(answer)

    @app.tool()
    async def quick(n: int) -> int:
        """Returns at once."""
        return n

    async with runner:
        yield env


async def cli(store: Store, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = await run_on_store(argv, store)
    return code, out.getvalue()


async def cli_json(store: Store, *argv: str) -> Any:
    # Options go before a "--" (task ids may start with "-": they come after it).
    at = argv.index("--") if "--" in argv else len(argv)
    code, out = await cli(store, *argv[:at], "--json", *argv[at:])
    assert code == 0, out
    return json.loads(out)


async def task_id_of(client: Client, tool: str, arguments: dict[str, JSONValue]) -> str:
    created = await client.call_tool(tool, arguments)
    assert created["resultType"] == "task"
    task_id = created["taskId"]
    assert isinstance(task_id, str)
    return task_id


async def populate(env: Env) -> dict[str, str]:
    """hold (alice, 0 s), ask (bob, 1 s, waiting for input), quick (alice, 2 s, completed);
    returns at 3 s."""
    ids = {"hold": await task_id_of(env.alice, "hold", {"label": "x"})}
    await trio.sleep(1)
    ids["ask"] = await task_id_of(env.bob, "ask", {"question": "Proceed?"})
    await trio.sleep(1)
    ids["quick"] = await task_id_of(env.alice, "quick", {"n": 7})
    await trio.sleep(1)  # 3 s: every attempt has done what it can (no polling: exact times)
    assert (await env.bob.get_task(ids["ask"]))["status"] == "input_required"
    assert (await env.alice.get_task(ids["quick"]))["status"] == "completed"
    return ids


async def test_list_shows_every_scope_with_leases_in_creation_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as env:
        ids = await populate(env)
        listing = await cli_json(env.store, "tasks", "list")
        assert listing["now"] == at(3)
        assert listing["truncated"] is False
        assert [t["taskId"] for t in listing["tasks"]] == [ids["hold"], ids["ask"], ids["quick"]]
        hold, ask, quick = listing["tasks"]
        assert hold == {
            "taskId": ids["hold"],
            "status": "working",
            "statusMessage": "Task accepted",
            "tool": "hold",
            "workType": "tools/call",
            "scope": "alice",
            "createdAt": at(0),
            "lastUpdatedAt": at(0),
            "expiresAt": at(3600),
            "expired": False,
            "revision": 0,
            "retryCount": 0,
            "retryAt": None,
            "leaseGeneration": 1,
            "lease": {
                "owner": "runner-1",
                "generation": 1,
                "expiresAt": at(30),
                "live": True,
            },
            "inputRequests": [],
            "steps": 0,
            "suspended": None,
        }
        assert (ask["status"], ask["scope"], ask["inputRequests"]) == (
            "input_required",
            "bob",
            ["confirm"],
        )
        # Commits come at least 1 ms after the previous instant of the task.
        assert (ask["revision"], ask["lastUpdatedAt"]) == (1, at(1.001))
        # A settled attempt released its claim with its final event.
        assert (quick["status"], quick["lease"], quick["leaseGeneration"]) == ("completed", None, 1)

        async def ids_of(*argv: str) -> list[str]:
            return [
                t["taskId"] for t in (await cli_json(env.store, "tasks", "list", *argv))["tasks"]
            ]

        assert await ids_of("--status", "input_required") == [ids["ask"]]
        assert await ids_of("--status", "active") == [ids["hold"], ids["ask"]]
        assert await ids_of("--status", "completed,cancelled", "--status", "failed") == [
            ids["quick"]
        ]
        assert await ids_of("--tool", "quick") == [ids["quick"]]
        assert await ids_of("--tool", "hold", "--status", "terminal") == []
        assert await ids_of("--scope", '"alice"') == [ids["hold"], ids["quick"]]
        assert await ids_of("--scope", "null") == []
        assert await ids_of("--older-than", "2500ms") == [ids["hold"]]
        assert await ids_of("--older-than", "1h") == []
        first = await cli_json(env.store, "tasks", "list", "--limit", "2")
        assert ([t["taskId"] for t in first["tasks"]], first["truncated"]) == (
            [ids["hold"], ids["ask"]],
            True,
        )
        assert await ids_of("--limit", "2", "--all") == [ids["hold"], ids["ask"], ids["quick"]]

        code, table = await cli(env.store, "tasks", "list", "--limit", "2")
        assert code == 0
        assert table.splitlines() == [
            f"TASK{' ' * (len(ids['hold']) - 2)}STATUS          TOOL  CREATED                   AGE"
            "   REV  RETRIES"
            "  LEASE",
            f"{ids['hold']}  working         hold  {at(0)}  3.0s  0    0        "
            "runner-1 gen 1 expires in 27s",
            f"{ids['ask']}  input_required  ask   {at(1)}  2.0s  1    0        "
            "runner-1 gen 1 expires in 28s",
            "2 tasks; more match (raise --limit, or --all)",
        ]
        code, empty = await cli(env.store, "tasks", "list", "--tool", "nothing")
        assert (code, empty) == (0, "no tasks match\n")


async def test_show_has_the_record_lease_retries_input_keys_and_ledger(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as env:
        ids = await populate(env)
        shown = await cli_json(env.store, "tasks", "show", "--", ids["ask"])
        assert shown["now"] == at(3)
        assert (shown["taskId"], shown["status"], shown["revision"]) == (
            ids["ask"],
            "input_required",
            1,
        )
        assert shown["lease"] == {
            "owner": "runner-1",
            "generation": 1,
            "expiresAt": at(31),
            "live": True,
        }
        assert (shown["retryCount"], shown["retryAt"], shown["lastFailure"]) == (0, None, None)
        assert shown["argumentNames"] == ["question"]
        assert shown["input"] == {"requested": ["confirm"], "answered": [], "used": ["confirm"]}
        assert (shown["ttlMs"], shown["pollIntervalMs"], shown["hasResult"]) == (
            3_600_000,
            250,
            False,
        )
        [asked] = shown["ledger"]
        assert asked == {
            "revision": 1,
            "committedAt": at(1.001),
            "kind": "input_requested",
            "eventId": asked["eventId"],
            "key": "confirm",
            "method": "elicitation/create",
        }
        # No payload: neither the question nor the arguments' values appear anywhere.
        assert "Proceed?" not in json.dumps(shown)

        await env.bob.update_task(ids["ask"], {"confirm": {"action": "accept", "content": {}}})
        await env.bob.wait_task(ids["ask"])
        done = await cli_json(env.store, "tasks", "show", "--", ids["ask"])
        assert [e["kind"] for e in done["ledger"]] == [
            "input_requested",
            "input_responses_accepted",
            "completed",
        ]
        assert done["ledger"][1]["offered"] == ["confirm"]
        assert done["ledger"][1]["accepted"] == ["confirm"]
        assert (done["status"], done["hasResult"], done["lease"]) == ("completed", True, None)

        code, text = await cli(env.store, "tasks", "show", "--", ids["quick"])
        assert code == 0
        lines = text.splitlines()
        assert f"task              {ids['quick']}" in lines
        assert "arguments         n" in lines
        assert "lease generation  1" in lines
        assert lines[-2:] == [
            "REV  COMMITTED                 EVENT      DETAIL",
            f"1    {at(2.001)}  completed",
        ]
        code, missing = await cli(env.store, "tasks", "show", "no-such-task")
        assert (code, missing) == (1, "")


async def test_cancel_is_a_store_transition_that_stops_the_running_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as env:
        ids = await populate(env)
        # Through the CLI's path (a runner of its own): the serving runner learns it from the
        # store at its next heartbeat (10 s), as a runner on another host would.
        before = trio.current_time()
        cancel = await cli_json(env.store, "tasks", "cancel", "--", ids["hold"])
        assert cancel == {
            "taskId": ids["hold"],
            "outcome": "cancelled",
            "status": "cancelled",
            "revision": 1,
        }
        with trio.fail_after(env.runner.heartbeat_ms / 1000 + 1):
            await env.stopped[ids["hold"]].wait()
        await trio.testing.wait_all_tasks_blocked()  # the attempt has ended
        assert env.cancelled[ids["hold"]] - before <= env.runner.heartbeat_ms / 1000
        stops = [md for _, md in env.events.named(ins.JOB_STOP) if md["task_id"] == ids["hold"]]
        assert [md["outcome"] for md in stops] == ["cancelled"]
        assert (await env.alice.get_task(ids["hold"]))["status"] == "cancelled"
        shown = await cli_json(env.store, "tasks", "show", "--", ids["hold"])
        assert [(e["kind"], e["revision"]) for e in shown["ledger"]] == [("cancelled", 1)]

        # With the serving process's own runner (an operator inside the app), the attempt has
        # stopped before the call returns.
        another = await task_id_of(env.alice, "hold", {"label": "y"})
        await trio.sleep(1)
        report = await ops.cancel_task(env.store, another, runner=env.runner)
        assert report == ops.CancelReport(
            task_id=another,
            outcome=ops.CancelOutcome.CANCELLED,
            status=TaskStatus.CANCELLED,
            revision=1,
        )
        assert env.cancelled[another] == trio.current_time()

        code, text = await cli(env.store, "tasks", "cancel", "--", ids["quick"])
        assert (code, text) == (1, f"task {ids['quick']} is already completed: nothing to cancel\n")
        code, text = await cli(env.store, "tasks", "cancel", "--", ids["hold"])
        assert (code, text) == (0, f"task {ids['hold']} is already cancelled: nothing to cancel\n")
        code, text = await cli(env.store, "tasks", "cancel", "--json", "ghost")
        assert code == 1
        assert json.loads(text) == {
            "taskId": "ghost",
            "outcome": "not_found",
            "status": None,
            "revision": None,
        }


async def test_stats_counts_and_flags_leases_that_need_attention(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as env:
        ids = await populate(env)
        # A task claimed by a host that died: its lease lapses, and nothing recovers it here.
        access = await env.store.authorize(_Principal("carol"), Action.CREATE, "orphan")
        task = new_task("orphan", await env.store.now(), None, None)
        await env.store.create(task, Work.tool_call("orphan", "hold", {"label": "z"}), access)
        assert await env.store.claim("orphan", "dead-host", 5_000) is not NOT_FOUND
        await trio.sleep(6)  # 9 s: before the runner's first heartbeats (10 s after each claim)
        stats = await cli_json(env.store, "tasks", "stats", "--expiring-within", "25s")
        assert stats["now"] == at(9)
        assert stats["total"] == 4
        assert stats["byStatus"] == {
            "working": 2,
            "input_required": 1,
            "completed": 1,
            "failed": 0,
            "cancelled": 0,
        }
        zero = {"working": 0, "input_required": 0, "completed": 0, "failed": 0, "cancelled": 0}
        assert stats["byTool"] == [
            {"tool": "ask", "byStatus": {**zero, "input_required": 1}},
            {"tool": "hold", "byStatus": {**zero, "working": 2}},
            {"tool": "quick", "byStatus": {**zero, "completed": 1}},
        ]
        assert stats["oldestActive"]["taskId"] == ids["hold"]
        assert stats["oldestActive"]["ageMs"] == 9000
        # hold's lease ends at 30 s (21 s away), ask's at 31 s (22 s away): both within 25 s.
        assert [t["taskId"] for t in stats["leasesExpiring"]] == [ids["hold"], ids["ask"]]
        assert [t["taskId"] for t in stats["leasesLapsed"]] == ["orphan"]
        assert stats["leasesLapsed"][0]["lease"] == {
            "owner": "dead-host",
            "generation": 1,
            "expiresAt": at(8),
            "live": False,
        }
        narrow = await cli_json(env.store, "tasks", "stats", "--expiring-within", "21s")
        assert [t["taskId"] for t in narrow["leasesExpiring"]] == [ids["hold"]]
        assert (stats["retrying"], stats["expired"]) == (0, 0)

        code, text = await cli(env.store, "tasks", "stats")
        assert code == 0
        lines = text.splitlines()
        assert lines[0] == (
            "tasks: 4 (working 2, input_required 1, completed 1, failed 0, cancelled 0) at " + at(9)
        )
        assert f"oldest active task: {ids['hold']} (hold, working, 9.0s old)" in lines
        assert "leases expiring within 10s: 0" in lines
        assert "lapsed leases (awaiting recovery): 1" in lines
        assert "  orphan  dead-host gen 1 lapsed" in lines


async def test_reap_deletes_expired_tasks_and_lists_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as env:
        ids = await populate(env)
        await env.alice.cancel_task(ids["hold"])
        await env.bob.cancel_task(ids["ask"])
        assert await cli_json(env.store, "reap") == {"reaped": [], "count": 0}
        await trio.sleep(3600 - 3 + 1.5)  # hold and ask expired (created at 0 s and 1 s)
        listing = await cli_json(env.store, "tasks", "list")
        assert [(t["taskId"], t["expired"]) for t in listing["tasks"]] == [
            (ids["hold"], True),
            (ids["ask"], True),
            (ids["quick"], False),
        ]
        reaped = await cli_json(env.store, "reap")
        assert reaped == {"reaped": sorted([ids["hold"], ids["ask"]]), "count": 2}
        code, text = await cli(env.store, "reap")
        assert (code, text) == (0, "reaped 0 expired tasks\n")
        assert [t.task_id for t in (await env.store.list_tasks(TaskQuery())).tasks] == [
            ids["quick"]
        ]


async def test_listing_is_never_served_over_mcp(autojump_clock: trio.testing.MockClock) -> None:
    async with serving() as env:
        await populate(env)
        for method in ("tasks/list", "tasks/stats", "tasks/show"):
            with pytest.raises(ClientError) as refused:
                await env.alice.request(method, {})
            assert refused.value.code == -32601


class _Principal:
    def __init__(self, principal: str) -> None:
        self.principal = principal


class _Forwarding:
    """A wrapper that forwards everything by ``__getattr__``: capabilities are detected on
    the class, so it offers none it does not define."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_store_without_the_capability_is_refused_by_name() -> None:
    wrapped = _Forwarding(MemoryStore(scope="shared"))
    assert not lists_tasks(wrapped)
    with pytest.raises(ops.NotAnOperatorStore, match="does not offer the operator capability"):
        await run_on_store(["tasks", "list"], wrapped)


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("30s", 30_000), ("1.5s", 1500), ("10m", 600_000), ("2h", 7_200_000),
     ("7d", 604_800_000), ("45", 45_000), (" 3s ", 3000)],
)  # fmt: skip
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "s", "-1s", "1w", "1e3", "1.s", "inf", "9" * 30 + "d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(Exception, match="duration"):
        parse_duration_ms(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tasks", "list", "--status", "running"], "unknown status 'running'"),
        (["tasks", "list", "--scope", "{nope"], "--scope takes the scope value as JSON"),
        (["tasks", "list", "--limit", "0"], "--limit must be an integer in 1..10000"),
        (["tasks", "list", "--older-than", "soon"], "not a duration: 'soon'"),
        (["tasks", "show"], "the following arguments are required: ID"),
    ],
)
async def test_usage_errors_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        await run_on_store(argv, MemoryStore(scope="shared"))
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
