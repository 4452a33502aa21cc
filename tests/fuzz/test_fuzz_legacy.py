"""Issue 18's fuzzer in the initialize era (2025-06-18, 2025-11-25) on every transport.

A ``LegacyEra`` session: ``initialize`` with a generated version and capabilities, then
``notifications/initialized``; on HTTP every later request carries ``Mcp-Session-Id`` and
``MCP-Protocol-Version``, and the SSE answers of ``tools/call`` carry the server's own
requests (``elicitation/create``...), which the fuzzer answers with generated results and
errors. Same promises as the modern era: no 5xx, no ``-32603`` (but the fixture's deliberate
``protocol_error_job``), no other traceback in the log, the server still answers (``ping``).
"""

from __future__ import annotations

import random
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
from stress.fuzz.eras import LegacyEra, legacy_era
from stress.fuzz.run import fuzz

BOUNDED = 60


def era() -> LegacyEra:
    return legacy_era(random.randrange(2**32))


def assert_clean(fuzzer: Fuzzer) -> None:
    report = fuzzer.ledger.report()
    context = (fuzzer.era.name, report)
    assert report["violations"] == [], context
    assert report["requests"] >= BOUNDED, context
    assert set(report["methods"]) >= {
        "initialize",
        "tools/call",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "resources/read",
        "prompts/get",
        "completion/complete",
    }, context
    assert report["tasksCreated"] == 0, context
    if isinstance(fuzzer.era, LegacyEra) and fuzzer.era.capabilities:  # the server asked
        assert any(method.startswith("(server) ") for method in report["methods"]), context


async def test_fuzz_legacy_streamable_http(tmp_path: Path) -> None:
    async with http_served(tmp_path) as (driver, logs):
        fuzzer = Fuzzer(driver, era())
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert isinstance(fuzzer.era, LegacyEra) and fuzzer.era.session_id
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_legacy_websocket(tmp_path: Path) -> None:
    async with websocket_served(tmp_path) as (driver, logs):
        fuzzer = Fuzzer(driver, era())
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert driver.problems == []
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_legacy_stdio_process(tmp_path: Path) -> None:
    async with stdio_served(tmp_path) as (driver, stderr):
        fuzzer = Fuzzer(driver, era())
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert driver.problems == []
    assert_clean(fuzzer)
    assert_clean_log(stderr)


async def test_fuzz_legacy_streamable_http_with_oauth(tmp_path: Path) -> None:
    """The auth-on mode in a legacy session: initialize, every request and every answer to
    the server's own requests authenticated; every 7th generated request refused."""
    async with oauth_served(tmp_path) as (driver, credentials, logs):
        fuzzer = Fuzzer(driver, era(), credentials=credentials)
        await fuzz(fuzzer, examples=examples(BOUNDED))
        assert isinstance(fuzzer.era, LegacyEra) and fuzzer.era.session_id
    assert_clean(fuzzer)
    assert logs.tracebacks == []
    assert sum(credentials.refused.values()) >= examples(BOUNDED) // DEFAULT_EVERY - 1
