"""The tritask client drives every tasks fixture tool of the conformance app to its documented
end state, over Streamable HTTP, stdio and WebSocket, against a real ``tritask serve`` process.

Tasks are followed both ways: on a listen stream (the server grants ``taskIds``) and by
polling ``tasks/get`` (``listen_for_tasks=False``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest
import trio
from client_support import Answers
from fixture_process import STDIO_COMMAND, serve_fixture

from tritask.client import (
    Client,
    InternalError,
    MissingCapabilityError,
    TaskCancelled,
    TaskState,
    connect,
)
from tritask.testing import ServeProcess

TRANSPORTS = ("http", "stdio", "websocket")


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    with serve_fixture() as server:
        yield server


@asynccontextmanager
async def client_for(
    transport: str, served: ServeProcess, answers: Answers, **options: Any
) -> AsyncIterator[Client]:
    target: Any = {"http": served.url, "websocket": served.ws_url}.get(transport, STDIO_COMMAND)
    async with connect(
        target, elicitation=answers.elicit, sampling=answers.sample, **options
    ) as client:
        yield client


pytestmark = pytest.mark.parametrize("transport", TRANSPORTS)


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll"])
async def test_input_inside_a_task(transport: str, served: ServeProcess, listen: bool) -> None:
    answers = Answers()
    states: list[TaskState] = []
    with trio.fail_after(60):
        async with client_for(transport, served, answers, listen_for_tasks=listen) as client:
            assert client.server is not None and client.server.name == "tritask-conformance"
            result = await client.call_tool(
                "confirm_delete", {"filename": "a.txt"}, on_task_state=states.append
            )
    assert result.text == "Delete confirmed: true"
    assert result.task_id is not None and not result.is_error
    statuses = [state.status for state in states]
    assert statuses[-1] == "completed" and statuses.count("completed") == 1
    assert "input_required" in statuses
    assert set(statuses) <= {"working", "input_required", "completed"}
    assert [(r.key, r.method, r.task_id) for r in answers.seen] == [
        ("confirm-delete", "elicitation/create", result.task_id)
    ]
    assert answers.seen[0].message == "Delete a.txt?"


async def test_declined_input(transport: str, served: ServeProcess) -> None:
    answers = Answers(action="decline", content={})
    with trio.fail_after(60):
        async with client_for(transport, served, answers) as client:
            result = await client.call_tool("confirm_delete", {"filename": "b.txt"})
    assert result.text == "Delete confirmed: false"


async def test_partial_input_with_an_explicit_handle(transport: str, served: ServeProcess) -> None:
    with trio.fail_after(60):
        async with client_for(transport, served, Answers()) as client:
            call = await client.start_tool("multi_input")
            assert call.task is not None and call.task_id is not None
            seen: list[tuple[str, tuple[str, ...]]] = []
            answered: list[str] = []
            async with aclosing(call.updates()) as updates:
                async for state in updates:
                    keys = tuple(sorted(state.input_requests))
                    seen.append((state.status, keys))
                    # The tool asks its two questions from two trio tasks, so either may be
                    # committed first: the first answer waits until both are open.
                    if state.status != "input_required":
                        continue
                    if len(keys) == 2 and not answered:
                        answered.append("first-input")
                        await call.respond(
                            "first-input", {"action": "accept", "content": {"name": "partial-1"}}
                        )
                    elif keys == ("second-input",) and answered == ["first-input"]:
                        answered.append("second-input")
                        await call.respond(
                            "second-input", {"action": "accept", "content": {"name": "partial-2"}}
                        )
            result = await call.result()
    assert result.text == "Inputs received: partial-1, partial-2"
    assert seen[-1] == ("completed", ())
    both = seen.index(("input_required", ("first-input", "second-input")))
    # After the first answer only the second question is open (it may also have been open
    # alone before the first was asked).
    assert ("input_required", ("second-input",)) in seen[both + 1 :]


async def test_cancellation(transport: str, served: ServeProcess) -> None:
    with trio.fail_after(60):
        async with client_for(transport, served, Answers()) as client:
            call = await client.start_tool("slow_compute", {"seconds": 60, "label": "c"})
            status = await call.status()
            assert status is not None and status.status == "working"
            await call.cancel()
            with pytest.raises(TaskCancelled) as raised:
                await call.result()
            again = await call.status()
    assert raised.value.task_id == call.task_id
    assert again is not None and again.status == "cancelled"
    assert again.status_message == "Cancellation requested"


async def test_mrtr_then_task(transport: str, served: ServeProcess) -> None:
    answers = Answers()
    with trio.fail_after(60):
        async with client_for(transport, served, answers) as client:
            result = await client.call_tool("test_tool_with_task")
    assert result.text == "Hello, Alice; task completed"
    assert result.task_id is not None
    # The name was asked once, in the MRTR round before the task existed.
    assert [(r.key, r.task_id) for r in answers.seen] == [("user_name", None)]


async def test_tool_error_is_a_completed_task(transport: str, served: ServeProcess) -> None:
    with trio.fail_after(60):
        async with client_for(transport, served, Answers()) as client:
            result = await client.call_tool("failing_job")
    assert result.is_error and result.text == "The task job failed"
    assert result.task_id is not None


async def test_failure_raises_the_task_error(transport: str, served: ServeProcess) -> None:
    with trio.fail_after(60):
        async with client_for(transport, served, Answers()) as client:
            with pytest.raises(InternalError) as raised:
                await client.call_tool("protocol_error_job")
    error = raised.value
    assert (error.code, error.message, error.data) == (-32603, "Task tool failed", None)
    assert error.task_id is not None and error.method is None


async def test_sync_and_optional_tools(transport: str, served: ServeProcess) -> None:
    with trio.fail_after(60):
        async with client_for(transport, served, Answers()) as client:
            greeting = await client.call_tool("greet", {"name": "trio"})
            computed = await client.call_tool("slow_compute", {"seconds": 0.2, "label": "x"})
        async with client_for(transport, served, Answers(), tasks=False) as plain:
            direct = await plain.call_tool("slow_compute", {"seconds": 0, "label": "y"})
            with pytest.raises(MissingCapabilityError) as raised:
                await plain.call_tool("failing_job")
    assert (greeting.text, greeting.task_id) == ("Hello, trio!", None)
    assert computed.text == "Completed x" and computed.task_id is not None
    assert (direct.text, direct.task_id) == ("Completed y", None)
    assert raised.value.required == {"extensions": {"io.modelcontextprotocol/tasks": {}}}
