"""The official MCP conformance suite (alpha.12) at the initialize-era revisions.

``--suite all --spec-version 2025-11-25`` (33 scenarios, the pending ``json-schema-2020-12``
and ``server-sse-polling`` included) and ``--suite all --spec-version 2025-06-18`` (27) run
against the same fixture app and endpoint as the 2026-07-28 run of ``test_conformance``: every
scenario must run, with no FAILURE and no WARNING, and with exactly the SUCCESS checks below.

The harness's own client offers 2025-11-25 in every SDK-driven scenario even at
``--spec-version 2025-06-18`` (only ``server-initialize``'s second probe,
``server-session-lifecycle`` and the schema validation use the version asked for), so the
2025-06-18 wire itself is covered by ``tests/transports/test_http_legacy.py``.
"""

from __future__ import annotations

import os
from typing import Final

import attrs
import pytest

from .harness import ConformanceRun, HarnessError, installed_version, npm_command, run_conformance

pytestmark = pytest.mark.conformance

COMMON: Final[dict[str, int]] = {
    "server-initialize": 3,
    "server-session-lifecycle": 3,
    "logging-set-level": 2,
    "ping": 2,
    "completion-complete": 2,
    "tools-list": 2,
    "tools-call-simple-text": 2,
    "tools-call-image": 2,
    "tools-call-audio": 2,
    "tools-call-embedded-resource": 2,
    "tools-call-mixed-content": 2,
    "tools-call-with-logging": 2,
    "tools-call-error": 2,
    "tools-call-with-progress": 2,
    "tools-call-sampling": 2,
    "tools-call-elicitation": 2,
}
"""SUCCESS checks of the scenarios both revisions run first, in the CLI's order (each has its
check plus ``wire-schema-valid``; the session scenarios have three checks and none)."""

RESOURCES_AND_PROMPTS: Final[dict[str, int]] = {
    "resources-list": 2,
    "resources-read-text": 2,
    "resources-read-binary": 2,
    "resources-templates-read": 2,
    "resources-subscribe": 2,
    "resources-unsubscribe": 2,
    "prompts-list": 2,
    "prompts-get-simple": 2,
    "prompts-get-with-args": 2,
    "prompts-get-embedded-resource": 2,
    "prompts-get-with-image": 2,
}

PASSED_CHECKS: Final[dict[str, dict[str, int]]] = {
    "2025-11-25": {
        **COMMON,
        "tools-list": 3,  # + tools-name-format, from 2025-11-25 on
        "json-schema-2020-12": 8,
        "elicitation-sep1034-defaults": 6,
        "server-sse-polling": 3,
        "server-sse-multiple-streams": 1,
        "elicitation-sep1330-enums": 6,
        **RESOURCES_AND_PROMPTS,
        "dns-rebinding-protection": 2,
    },
    "2025-06-18": {**COMMON, **RESOURCES_AND_PROMPTS},
}

TOTALS: Final = {"2025-11-25": (33, 83), "2025-06-18": (27, 56)}
"""Scenarios run and SUCCESS checks in all, per revision."""

VERSIONS: Final = tuple(PASSED_CHECKS)


@attrs.frozen
class LegacyRun:
    version: str
    run: ConformanceRun


@pytest.fixture(scope="module", params=VERSIONS)
def legacy(request: pytest.FixtureRequest) -> LegacyRun:
    """One ``--suite all --spec-version <version>`` run against a fresh fixture server."""
    if installed_version() is None and npm_command() is None:
        reason = "the conformance suite is not installed and no npm is available"
        if os.environ.get("TRITASK_REQUIRE_CONFORMANCE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        return LegacyRun(request.param, run_conformance(suite="all", spec_version=request.param))
    except HarnessError as error:
        pytest.fail(f"conformance harness error: {error}")


def _report(run: ConformanceRun) -> str:
    return (
        f"\n{run.suite.table()}\n\n{run.suite.summary_block}\n\n"
        f"--- suite stderr ---\n{run.suite.stderr[-4000:]}\n"
        f"--- server stderr ---\n{run.server_stderr[-4000:]}"
    )


def test_expected_counts_add_up() -> None:
    for version, (count, passed) in TOTALS.items():
        assert len(PASSED_CHECKS[version]) == count
        assert sum(PASSED_CHECKS[version].values()) == passed


def test_every_scenario_runs_in_order_and_the_suite_exits_zero(legacy: LegacyRun) -> None:
    run = legacy.run
    expected = tuple(PASSED_CHECKS[legacy.version])
    assert run.suite.returncode == 0, _report(run)
    assert tuple(line.scenario for line in run.suite.summary) == expected, _report(run)
    assert sorted(run.suite.scenarios) == sorted(expected), _report(run)
    assert run.suite.not_scored == {}


def test_every_scenario_is_clean_with_its_exact_count(legacy: LegacyRun) -> None:
    run = legacy.run
    counts = {
        name: (result.passed, result.failed, result.warnings, result.skipped)
        for name, result in run.suite.scenarios.items()
    }
    expected = {name: (passed, 0, 0, 0) for name, passed in PASSED_CHECKS[legacy.version].items()}
    assert counts == expected, _report(run)
    assert all(line.ok for line in run.suite.summary), _report(run)


def test_sse_polling_primes_retries_and_resumes(legacy: LegacyRun) -> None:
    """The one scenario whose checks would be WARNINGs (not failures) if resumption broke."""
    if legacy.version != "2025-11-25":
        assert "server-sse-polling" not in legacy.run.suite.scenarios
        return
    checks = legacy.run.suite.scenarios["server-sse-polling"].checks
    assert {check.id: check.status for check in checks if check.status != "INFO"} == {
        "server-sse-priming-event": "SUCCESS",
        "server-sse-retry-field": "SUCCESS",
        "server-sse-disconnect-resume": "SUCCESS",
    }, _report(legacy.run)
    resumed = [
        check
        for check in checks
        if check.id == "incoming-sse-event" and "GET reconnection" in check.description
    ]
    assert resumed, _report(legacy.run)


def test_totals(legacy: LegacyRun) -> None:
    run = legacy.run
    count, passed = TOTALS[legacy.version]
    assert len(run.suite.scenarios) == count
    assert (run.suite.total_passed, run.suite.total_failed) == (passed, 0), _report(run)


def test_server_exits_cleanly_without_tracebacks(legacy: LegacyRun) -> None:
    run = legacy.run
    assert run.server_returncode == 0, run.server_stderr
    assert "tritask: shutting down" in run.server_stderr
    assert "Traceback" not in run.server_stderr, run.server_stderr
