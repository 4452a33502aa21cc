"""``tritask call`` and ``tritask tools`` as a person uses them: real processes against a served
conformance fixture (HTTP) and a stdio server the command starts itself, with answers typed on
stdin, and once on a pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from fixture_process import FIXTURE, serve_fixture

from tritask.client import connect
from tritask.client.model import Tool
from tritask.client.terminal import parse_assignments
from tritask.testing import ServeProcess

TRITASK = [sys.executable, "-m", "tritask"]
STDIO_SERVER = ["--", *TRITASK, "serve", FIXTURE, "--stdio", "--store", "memory:"]


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    with serve_fixture(ws=False) as server:
        yield server


def tritask(*words: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRITASK, *words],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "TRITASK_LOG_LEVEL": "WARNING"},
    )


def test_tools_lists_names_and_summaries(served: ServeProcess) -> None:
    done = tritask("tools", served.url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "test_simple_text",
        "Returns",
        "a",
        "single",
        "text",
        "content",
        "item.",
    ]
    assert any(line.startswith("confirm_delete ") for line in lines)
    as_json = tritask("tools", served.url, "--json")
    names = [tool["name"] for tool in json.loads(as_json.stdout)]
    assert len(names) == len(lines) and "multi_input" in names


def test_tools_of_a_stdio_server() -> None:
    done = tritask("tools", *STDIO_SERVER)
    assert done.returncode == 0, done.stderr
    assert "greet" in [line.split()[0] for line in done.stdout.splitlines()]
    assert done.stderr == ""  # the server's own log stays out of the way


def test_a_task_with_its_status_live(served: ServeProcess) -> None:
    done = tritask("call", served.url, "slow_compute", "seconds=0.5", "label=cli")
    assert (done.returncode, done.stdout) == (0, "Completed cli\n"), done.stderr
    status = done.stderr.splitlines()
    assert status[0].startswith("task ") and status[0].endswith(": created")
    assert status[-1].endswith(": completed")
    task_id = status[0].split()[1].rstrip(":")
    assert all(line.startswith(f"task {task_id}: ") for line in status)


def test_an_elicitation_answered_on_stdin(served: ServeProcess) -> None:
    done = tritask("call", served.url, "confirm_delete", "filename=a.txt", stdin="maybe\ny\n")
    assert (done.returncode, done.stdout) == (0, "Delete confirmed: true\n"), done.stderr
    assert "? Delete a.txt?" in done.stderr
    assert "answer y or n" in done.stderr  # "maybe" was asked again


def test_two_questions_and_no_input(served: ServeProcess) -> None:
    done = tritask("call", served.url, "multi_input", stdin="Ada\nGrace\n")
    # The two questions are open at once; the terminal asks them in the order they came.
    first_asked = done.stderr.index("? First input?") < done.stderr.index("? Second input?")
    expected = "Ada, Grace" if first_asked else "Grace, Ada"
    assert done.stdout == f"Inputs received: {expected}\n", done.stderr
    declined = tritask("call", served.url, "confirm_delete", "--no-input")
    assert declined.stdout == "Delete confirmed: false\n", declined.stderr
    assert "declining input 'confirm-delete'" in declined.stderr
    # End of input while a question is open cancels the elicitation.
    ended = tritask("call", served.url, "confirm_delete", stdin="")
    assert ended.stdout == "Delete confirmed: false\n", ended.stderr


def test_mrtr_then_task_over_stdio() -> None:
    done = tritask("call", "test_tool_with_task", *STDIO_SERVER, stdin="Alice\n")
    assert (done.returncode, done.stdout) == (0, "Hello, Alice; task completed\n"), done.stderr
    assert "? What is your name?" in done.stderr


def test_json_output_and_exit_statuses(served: ServeProcess) -> None:
    tool_error = tritask("call", served.url, "failing_job", "--json")
    assert tool_error.returncode == 1, tool_error.stderr
    result = json.loads(tool_error.stdout)
    assert (result["isError"], result["content"]) == (
        True,
        [{"type": "text", "text": "The task job failed"}],
    )
    failed = tritask("call", served.url, "protocol_error_job")
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.splitlines()[-1].startswith("tritask: -32603: Task tool failed (task ")
    unknown = tritask("call", served.url, "nope")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        "tritask: -32602: Unknown tool: nope",
    )
    usage = tritask("call", served.url, "greet", "oops")
    assert (usage.returncode, usage.stderr.strip()) == (
        2,
        "tritask call: expected key=value, got 'oops'",
    )
    assert tritask("call", "greet", "--").returncode == 2
    refused = tritask("call", "http://127.0.0.1:9/mcp", "greet")
    assert refused.returncode == 1 and "failed" in refused.stderr


def test_progress_of_a_sync_call(served: ServeProcess) -> None:
    done = tritask("call", served.url, "test_tool_with_progress")
    assert done.stdout == "Progress test completed\n", done.stderr
    assert done.stderr.splitlines() == [
        "progress 0/100 started",
        "progress 50/100 halfway",
        "progress 100/100 done",
    ]


def test_arguments_are_typed_by_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "zip": {"type": "string"},
            "count": {"type": "integer"},
            "tags": {"type": "array"},
        },
    }
    tool = Tool("t", None, schema, {"name": "t"})
    assert parse_assignments(
        ["zip=01234", "count=3", 'tags=["a"]', "free=true", "text=hello", "eq=a=b"], tool
    ) == {"zip": "01234", "count": 3, "tags": ["a"], "free": True, "text": "hello", "eq": "a=b"}
    with pytest.raises(Exception, match="count is integer"):
        parse_assignments(["count=three"], tool)


def _read_until(master: int, needle: bytes, deadline: float) -> bytes:
    seen = b""
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"never saw {needle!r} in {seen!r}")
        ready, _, _ = select.select([master], [], [], remaining)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_on_a_terminal(served: ServeProcess) -> None:
    """A person at a terminal: the question appears, they type the answer, the result shows."""
    master, slave = pty.openpty()
    process: Any = subprocess.Popen(
        [*TRITASK, "call", served.url, "confirm_delete", "filename=tty.txt"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TRITASK_LOG_LEVEL": "WARNING"},
        close_fds=True,
    )
    os.close(slave)
    try:
        deadline = time.monotonic() + 60
        shown = _read_until(master, b"Confirm [y/n]: ", deadline)
        assert b"? Delete tty.txt?" in shown
        os.write(master, b"y\n")
        shown += _read_until(master, b"Delete confirmed: true", deadline)
        assert process.wait(timeout=30) == 0
        assert b": completed" in shown
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def test_ctrl_c_cancels_the_task(served: ServeProcess) -> None:
    process = subprocess.Popen(
        [*TRITASK, "call", served.url, "slow_compute", "seconds=60", "label=long"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TRITASK_LOG_LEVEL": "WARNING"},
    )
    assert process.stderr is not None
    try:
        first = process.stderr.readline()
        assert first.endswith(": created\n"), first
        task_id = first.split()[1].rstrip(":")
        assert process.stderr.readline() == f"task {task_id}: working (Task accepted)\n"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert rest == f"task {task_id}: cancel requested\n"

    async def status() -> str:
        async with connect(served.url) as client:
            return (await client.task(task_id).status()).status

    assert trio.run(status) == "cancelled"
