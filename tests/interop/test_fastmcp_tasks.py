"""Interop: the FastMCP 4.1.4 client with fastmcp-tasks 4.1.4 drives tritask's tasks over HTTP.

That client omits ``Mcp-Name`` on ``tasks/get|update|cancel`` (SEP-2663 says clients MUST send
it); tritask serves those requests anyway because it routes by store, not by instance
(docs/security.md, "Routing headers"). Its dependencies conflict with the project's (it pins
its own ``mcp`` stack), so it runs in a virtualenv of its own that this test creates from the
pinned ``fastmcp-tasks-requirements.txt`` under ``.cache/venvs/`` (kept between runs, keyed by
the file's digest). ``fastmcp_tasks_driver.py`` runs one flow per process through the client's
public API against a real ``tritask serve`` of the conformance fixture.

Without network access to install the virtualenv the test is skipped, except where
``TRITASK_REQUIRE_INTEROP=1`` makes that a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixture_process import REPO, serve_fixture

from tritask.testing import ServeProcess

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "fastmcp-tasks-requirements.txt"
DRIVER = HERE / "fastmcp_tasks_driver.py"
VENVS = REPO / ".cache" / "venvs"


def _unavailable(reason: str) -> None:
    if os.environ.get("TRITASK_REQUIRE_INTEROP") == "1":
        pytest.fail(f"TRITASK_REQUIRE_INTEROP=1 but {reason}")
    pytest.skip(reason)


def ensure_venv() -> Path:
    """The virtualenv's python, created and installed once per requirements digest."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    home = VENVS / f"fastmcp-tasks-{digest}"
    python = home / "bin" / "python"
    done = home / ".installed"
    if done.exists():
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    with (VENVS / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        venv.EnvBuilder(with_pip=True, clear=True).create(home)
        completed = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "-r",
                str(REQUIREMENTS),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if completed.returncode != 0:
            _unavailable(f"installing the FastMCP virtualenv failed:\n{completed.stderr[-2000:]}")
        done.write_text(digest + "\n", "utf-8")
    return python


@pytest.fixture(scope="module")
def python() -> Path:
    return ensure_venv()


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    with serve_fixture(ws=False) as server:
        yield server


def drive(python: Path, url: str, flow: str) -> dict[str, Any]:
    # The driver must not see this project's PYTHONPATH: it runs on the venv's own packages.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    completed = subprocess.run(
        [str(python), str(DRIVER), url, flow],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr
    outcome: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return outcome


def test_create_and_follow(python: Path, served: ServeProcess) -> None:
    assert drive(python, served.url, "follow") == {"texts": ["Completed fm"]}


def test_explicit_handle(python: Path, served: ServeProcess) -> None:
    outcome = drive(python, served.url, "handle")
    assert isinstance(outcome.pop("task_id", None), str), outcome
    assert outcome == {"first": "working", "final": "completed", "texts": ["Completed h"]}


def test_input_inside_a_task(python: Path, served: ServeProcess) -> None:
    assert drive(python, served.url, "input") == {
        "texts": ["Delete confirmed: true"],
        "asked": ["Delete fm.txt?"],
    }


def test_cancel(python: Path, served: ServeProcess) -> None:
    assert drive(python, served.url, "cancel") == {
        "final": "cancelled",
        "message": "Cancellation requested",
    }


def test_mrtr_then_task(python: Path, served: ServeProcess) -> None:
    assert drive(python, served.url, "mrtr_task") == {
        "texts": ["Hello, Alice; task completed"],
        "asked": ["What is your name?"],
    }
