"""The stress workloads on the memory store, small sizes: invariants, determinism, faults."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stress.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> tuple[int, dict[str, Any]]:
    """Run a stress command in-process the way the CLI does and return (status, report)."""
    from stress import cli

    args = build_parser().parse_args([*argv, "--json"])
    reports: list[dict[str, Any]] = []
    original = cli.dump_report
    cli.dump_report = lambda report, stream=None: reports.append(dict(report))
    try:
        status = args.handler(args)
    finally:
        cli.dump_report = original
    assert len(reports) == 1
    return status, reports[0]


def test_cas_invariants_hold_with_exact_figures() -> None:
    status, report = run("cas", "--tasks", "4", "--writers", "5", "--depth", "3", "--seed", "11")
    assert status == 0, report["invariants"]["failures"]
    assert report["ok"] is True
    assert report["schemaVersion"] == 1
    assert set(report) == {"schemaVersion", "workload", "ok", "params", "invariants", "timings"}
    inv = report["invariants"]
    assert inv["attempts"] == 4 * 5 * 3
    assert inv["applied"] == 12
    assert inv["conflicts"] == 12 * 4
    assert inv["unexpected"] == {}
    assert inv["duplicatesReplayed"] == 12
    assert inv["loserRetriesConflicted"] == 48
    assert inv["eventIdReuseRefused"] == 12
    assert inv["committedEvents"] == 12
    assert inv["ledgerTasksChecked"] == 4
    assert inv["terminalTasks"] == 4
    assert sum(inv["finalStatuses"].values()) == 4
    assert all(inv["checks"].values()) and inv["failures"] == []
    assert report["params"]["clock"] == "mock"


def test_runner_invariants_hold_for_every_kind() -> None:
    status, report = run("runner", "--rounds", "2", "--batch", "9", "--seed", "3")
    assert status == 0, report["invariants"]["failures"]
    inv = report["invariants"]
    kinds = inv["plannedKinds"]
    assert set(kinds) == {
        "complete",
        "tool_error",
        "fail",
        "retry",
        "input",
        "cancel",
        "lease_loss",
    }
    assert sum(kinds.values()) == 18
    assert inv["started"] == inv["stopped"] == inv["expectedJobs"]
    assert inv["jobsPerRunner"]["B"]["started"] == kinds["lease_loss"]
    assert inv["peakJobs"]["A"] == 9
    assert inv["trioTasksAtEnd"] == 0
    assert inv["trioTasksBeforeRounds"] == inv["trioTasksAfterRounds"]
    assert inv["stopOutcomes"]["A:fenced"] == kinds["lease_loss"]
    assert inv["stopOutcomes"]["A:cancelled:not_settled"] == kinds["cancel"]
    assert all(inv["checks"].values())


def test_steps_invariants_hold_with_exact_figures() -> None:
    status, report = run("steps", "--tasks", "16", "--steps", "5", "--kills", "8", "--seed", "3")
    assert status == 0, report["invariants"]["failures"]
    inv = report["invariants"]
    assert inv["plannedKinds"] == {"at_most_once": 4, "input": 4, "plain": 4, "sleep": 4}
    assert sum(inv["plannedKills"].values()) == 8
    fired = sum(inv["killsFired"].values())
    assert fired + inv["killsSkippedInInterruptedSteps"] == 8
    assert inv["finalStatuses"] == {"completed": 16}
    assert inv["incarnations"] >= 2
    # Every body ran once, plus once per kill that found it in flight without an outcome.
    assert inv["bodyRuns"] == 16 * 5 + inv["bodiesRunAgain"]
    assert inv["effects"] <= inv["bodyRuns"]
    assert set(inv["checks"]) == {
        "bodyRunsExact",
        "effectsAtMostRuns",
        "everyPlannedKillFired",
        "everyTaskCompleted",
        "exactValues",
        "finishesInTime",
        "ledgers",
        "noBodyAfterItsOutcome",
    }
    assert all(inv["checks"].values())


@pytest.mark.parametrize(
    "argv",
    [
        ("cas", "--tasks", "6", "--writers", "4"),
        ("runner", "--rounds", "2", "--batch", "10"),
        ("steps", "--tasks", "12", "--kills", "6"),
    ],
)
def test_same_seed_gives_identical_invariants(argv: tuple[str, ...]) -> None:
    first = run(*argv, "--seed", "42")[1]
    second = run(*argv, "--seed", "42")[1]
    other = run(*argv, "--seed", "43")[1]
    assert json.dumps(first["invariants"], sort_keys=True) == json.dumps(
        second["invariants"], sort_keys=True
    )
    assert first["ok"] and other["ok"]
    assert first["params"]["seed"] == 42


def test_a_broken_store_fails_the_invariants_with_exit_1() -> None:
    status, report = run("cas", "--tasks", "2", "--writers", "3", "--fault", "cas-retry-conflicts")
    assert status == 1
    assert report["ok"] is False
    assert report["invariants"]["checks"]["casExactlyOneWinnerPerRevision"] is False
    assert report["invariants"]["checks"]["exactlyOneCommitPerRevision"] is False


def test_a_stuck_workload_times_out_with_exit_1() -> None:
    status, report = run(
        "runner", "--rounds", "1", "--batch", "8", "--timeout-ms", "5000", "--fault", "lost-release"
    )
    assert status == 1
    assert report["ok"] is False
    checks = report["invariants"]["checks"]
    assert checks["roundsFinishInTime"] is False
    assert report["invariants"]["failures"][0].startswith("roundsFinishInTime: round 0 timed out")


def test_cli_prints_exactly_one_json_object_and_exit_status() -> None:
    good = subprocess.run(
        [sys.executable, "-m", "stress", "cas", "--json", "-T", "2", "-W", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert good.returncode == 0, good.stderr
    lines = good.stdout.splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["ok"] is True
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "stress",
            "cas",
            "--json",
            "-T",
            "2",
            "-W",
            "2",
            "--fault",
            "cas-retry-conflicts",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["ok"] is False


def test_text_output_without_json() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stress", "runner", "-R", "1", "-N", "7"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("Invariants: passed")
    assert "\r" not in done.stderr  # no progress bar when stderr is not a terminal


SQL_STORES = []
if importlib.util.find_spec("tritask_sqlite") is not None:
    SQL_STORES.append("sqlite")
if os.environ.get("TRITASK_TEST_POSTGRES_DSN") and importlib.util.find_spec("tritask_postgres"):
    SQL_STORES.append("postgresql")


@pytest.mark.parametrize("kind", SQL_STORES or [pytest.param("none", marks=pytest.mark.skip)])
def test_workloads_on_the_sql_stores(kind: str, tmp_path: Path) -> None:
    if kind == "sqlite":
        url = f"sqlite:{tmp_path / 'stress.db'}"
    else:
        url = os.environ["TRITASK_TEST_POSTGRES_DSN"]
    status, report = run("cas", "--store", url, "--tasks", "3", "--writers", "4", "--depth", "3")
    assert status == 0, report["invariants"]
    assert report["params"]["clock"] == "real"
    assert report["invariants"]["ledgerTasksChecked"] == 3
    status, report = run(
        "runner", "--store", url, "--rounds", "1", "--batch", "7", "--lease-ms", "300"
    )
    assert status == 0, report["invariants"]
    assert report["invariants"]["jobsPerRunner"]["B"]["started"] >= 1


def test_fuzz_against_a_tritask_serve_process_on_sqlite(tmp_path: Path) -> None:
    """The in-suite size of ``python -m stress fuzz --requests 2000`` (issue 18)."""
    status, report = run("fuzz", "--requests", "150", "--store", f"sqlite:{tmp_path / 'f.db'}")
    inv = report["invariants"]
    assert status == 0, inv["failures"]
    assert report["ok"] is True
    assert inv["generatedRequests"] == 150
    assert inv["requests"] > 150  # discovery, tour and settling come on top
    assert not any(int(code) >= 500 for code in inv["httpStatuses"])
    assert "-32603" not in inv["errorCodes"]
    assert inv["tasksCreated"] > 0
    assert inv["tasksFailedInternalUnexpected"] == 0
    assert inv["tracebacks"]["found"] == inv["tracebacks"]["fixtureCrashes"]
    assert all(inv["checks"].values())


def test_fuzz_with_oauth_against_a_tritask_serve_process(tmp_path: Path) -> None:
    """``python -m stress fuzz --oauth``: the serve process requires bearer tokens."""
    status, report = run(
        "fuzz", "--oauth", "--requests", "150", "--store", f"sqlite:{tmp_path / 'f.db'}"
    )
    inv = report["invariants"]
    assert status == 0, inv["failures"]
    assert report["params"]["oauth"] is True
    assert inv["generatedRequests"] == 150
    refused = inv["credentials"]["faultsRefused"]
    assert set(refused) == {
        "missing",
        "basic scheme",
        "empty bearer",
        "malformed bearer",
        "garbage bearer",
        "expired",
        "foreign audience",
    }
    assert sum(refused.values()) >= 150 // 7 - 1
    assert inv["httpStatuses"]["401"] >= refused["missing"] + refused["expired"]
    assert inv["tasksFailedInternalUnexpected"] == 0
    assert all(inv["checks"].values())
