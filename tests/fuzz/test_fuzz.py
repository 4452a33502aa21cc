"""Issue 18's black-box fuzzer on every transport, against the conformance fixture on SQLite.

Valid 2026-07-28 envelopes with generated parameters for every method (``stress.fuzz``), sent
through a real socket or a real process: Streamable HTTP (``serve_http``), stdio (``python -m
tritask serve examples/conformance_fixture.py:app --stdio``) and WebSocket
(``serve_websocket``). The bounded run here takes a few seconds per transport; a longer one::

    python -m pytest tests/fuzz --hypothesis-profile=fuzz-long

(any profile but the default sets the number of examples per transport to its
``max_examples``). ``python -m stress fuzz`` runs thousands of requests against a ``tritask
serve`` process and prints the figures.
"""

from __future__ import annotations

from pathlib import Path

from fuzz_support import (
    assert_clean_log,
    examples,
    http_served,
    oauth_served,
    stdio_served,
    websocket_served,
)

from stress.fuzz import Fuzzer
from stress.fuzz.auth import DEFAULT_EVERY
from stress.fuzz.run import fuzz

BOUNDED = 150


def assert_clean(fuzzer: Fuzzer) -> None:
    report = fuzzer.ledger.report()
    assert report["violations"] == [], report
    assert report["requests"] >= BOUNDED
    assert set(report["methods"]) >= {
        "tools/call",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",
        "resources/read",
        "prompts/get",
        "completion/complete",
        "subscriptions/listen",
    }, report
    assert report["tasksCreated"] > 0, report
    assert report["tasksFailedInternalUnexpected"] == 0, report


async def test_fuzz_streamable_http(tmp_path: Path) -> None:
    async with http_served(tmp_path) as (driver, logs):
        fuzzer = Fuzzer(driver)
        await fuzz(fuzzer, examples=examples(BOUNDED))
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_websocket(tmp_path: Path) -> None:
    async with websocket_served(tmp_path) as (driver, logs):
        fuzzer = Fuzzer(driver)
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert driver.problems == []
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_stdio_process(tmp_path: Path) -> None:
    async with stdio_served(tmp_path) as (driver, stderr):
        fuzzer = Fuzzer(driver)
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert driver.problems == []
    assert_clean(fuzzer)
    assert_clean_log(stderr)


async def test_fuzz_streamable_http_with_oauth(tmp_path: Path) -> None:
    """The auth-on mode: every request authenticated, every 7th generated one refused."""
    async with oauth_served(tmp_path) as (driver, credentials, logs):
        fuzzer = Fuzzer(driver, credentials=credentials)
        await fuzz(fuzzer, examples=examples(BOUNDED))
    assert_clean(fuzzer)
    assert logs.tracebacks == []
    assert sum(credentials.refused.values()) >= examples(BOUNDED) // DEFAULT_EVERY - 1
    assert len(credentials.refused) == len(credentials.faults)
