"""The official suite's client scenarios (alpha.12) against ``examples/conformance_client.py``.

The ``2026-07-28`` requirement set scores seven client scenarios besides OAuth; each runs on
its own at the 2026-07-28 wire, and each must pass with no FAILURE and no WARNING check and
with the exact count of SUCCESS checks below. The OAuth scenarios (``auth/…``) are not claimed:
the client's ``Authorization`` hook supplies credentials, it does not run OAuth flows.
"""

from __future__ import annotations

import os
from typing import Final

import pytest

from .harness import (
    HarnessError,
    SuiteResult,
    installed_version,
    npm_command,
    required_client_scenarios,
    run_client_conformance,
)

pytestmark = pytest.mark.conformance

PASSED_CHECKS: Final[dict[str, int]] = {
    "tools_call": 2,
    "request-metadata": 8,
    "sep-2322-client-request-state": 5,
    "http-standard-headers": 9,
    "http-custom-headers": 18,
    "http-invalid-tool-headers": 12,
    "json-schema-ref-no-deref": 1,
}
"""SUCCESS checks per scenario with alpha.12."""

SKIPPED_CHECKS: Final[dict[str, int]] = {"http-standard-headers": 2}
"""``initialize`` and ``notifications/initialized``: methods a 2026-07-28 client never sends."""


@pytest.fixture(scope="module")
def results() -> dict[str, SuiteResult]:
    if installed_version() is None and npm_command() is None:
        reason = "the conformance suite is not installed and no npm is available"
        if os.environ.get("TRITASK_REQUIRE_CONFORMANCE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        return run_client_conformance(tuple(PASSED_CHECKS))
    except HarnessError as error:
        pytest.fail(f"conformance harness error: {error}")


def _report(result: SuiteResult, scenario: str) -> str:
    return (
        f"\n{result.table((scenario,))}\n\n--- suite stdout ---\n{result.stdout[-6000:]}"
        f"\n--- suite stderr ---\n{result.stderr[-3000:]}"
    )


def test_the_requirement_set_scores_these_scenarios_besides_oauth(
    results: dict[str, SuiteResult],
) -> None:
    scored = required_client_scenarios()
    assert [name for name in scored if not name.startswith("auth/")] == list(PASSED_CHECKS)


@pytest.mark.parametrize("scenario", tuple(PASSED_CHECKS))
def test_client_scenario_passes(results: dict[str, SuiteResult], scenario: str) -> None:
    result = results[scenario]
    assert result.returncode == 0, _report(result, scenario)
    assert list(result.scenarios) == [scenario], _report(result, scenario)
    checks = result.scenarios[scenario]
    assert checks.failed == 0, _report(result, scenario)
    assert checks.warnings == 0, _report(result, scenario)
    assert checks.passed == PASSED_CHECKS[scenario], _report(result, scenario)
    assert checks.skipped == SKIPPED_CHECKS.get(scenario, 0), _report(result, scenario)
