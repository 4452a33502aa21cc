"""Each benchmark with tiny sizes: it runs to the end and reports the documented JSON keys.

The real benchmarks are never run by the test command (see docs/benchmarks.md); SQLite runs when
its package imports, PostgreSQL only when ``TRITASK_TEST_POSTGRES_DSN`` is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"name", "params", "tritask", "baseline", "ratio", "target_met"}
POSTGRES = os.environ.get("TRITASK_TEST_POSTGRES_DSN")
HAS_SQLITE = importlib.util.find_spec("tritask_sqlite") is not None
HAS_POSTGRES = importlib.util.find_spec("tritask_postgres") is not None


def python_module(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m ARGV`` from the repository's root, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def bench(*argv: str, expect_ok: bool = True) -> dict[str, Any]:
    done = python_module("stress", "bench", *argv, "--json")
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-3000:])
    result: dict[str, Any] = json.loads(lines[0])
    assert set(result) >= KEYS, result
    if expect_ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return result


def test_bench_core_smoke() -> None:
    result = bench(
        "core", "--concurrency", "1", "2", "--seconds", "0.3", "--warmup", "0.1", "--repeats", "1"
    )
    assert result["name"] == "core"
    assert result["errors"] == 0
    for side in ("tritask", "baseline", "hypercornCeiling"):
        assert set(result[side]) == {"c1", "c2"}
        for figures in result[side].values():
            assert figures["requests"] > 0
            assert figures["requestsPerSecond"] > 0
            assert {"p50Ms", "p99Ms", "meanMs"} <= set(figures)
    assert set(result["ratio"]) == {"c1", "c2"}
    assert isinstance(result["target_met"], bool)


def test_bench_core_legacy_smoke() -> None:
    """2025-11-25 sessions on both servers, and tritask modern in the same run."""
    result = bench(
        "core", "--era", "legacy", "--concurrency", "1", "2", "--seconds", "0.3",
        "--warmup", "0.1", "--repeats", "1",
    )  # fmt: skip
    assert result["name"] == "core"
    assert result["params"]["era"] == "legacy"
    assert result["params"]["sessions"] == "one 2025-11-25 session per connection"
    assert result["errors"] == 0
    for side in ("tritask", "baseline", "tritaskModern", "hypercornCeiling"):
        assert set(result[side]) == {"c1", "c2"}
        for figures in result[side].values():
            assert figures["requests"] > 0
            assert figures["errors"] == 0
            assert figures["requestsPerSecond"] > 0
    for key in ("c1", "c2"):
        cpu = [result[side][key]["serverCpuUsPerRequest"] for side in ("tritask", "baseline")]
        assert all(value > 0 for value in cpu), cpu
        assert result["serverCpuRatio"][key] == round(cpu[1] / cpu[0], 3)
        assert result["ratio"][key] == round(
            result["tritask"][key]["requestsPerSecond"]
            / result["baseline"][key]["requestsPerSecond"],
            3,
        )
        assert result["ratioToModern"][key] == round(
            result["tritask"][key]["requestsPerSecond"]
            / result["tritaskModern"][key]["requestsPerSecond"],
            3,
        )
    assert isinstance(result["target_met"], bool)


def test_bench_tasks_memory_smoke() -> None:
    result = bench("tasks", "--store", "memory:", "--tasks", "30", "--clients", "3")
    assert result["name"] == "tasks"
    assert result["tritask"]["completed"] == 30
    assert result["tritask"]["sampleStatuses"] == ["completed"]
    assert result["tritask"]["storeWritesPerTask"] >= 2  # e.g. create+claim, settle, release
    assert result["baseline"]["tasksPerSecond"] > 0
    assert result["target_met"] is None  # the 70% target is for the durable stores


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_tasks_sqlite_smoke() -> None:
    result = bench(
        "tasks", "--store", "sqlite:auto", "--tasks", "20", "--clients", "2", "--repeats", "2"
    )
    assert result["params"]["repeats"] == 2
    assert result["tritask"]["completed"] == 20
    # Interleaved rounds: the figures are the median (lower middle) round's, both sides.
    rounds = result["tritask"]["roundsTasksPerSecond"]
    raw_rounds = result["baseline"]["roundsTasksPerSecond"]
    assert len(rounds) == len(raw_rounds) == 2
    assert result["tritask"]["tasksPerSecond"] == min(rounds)
    assert result["baseline"]["tasksPerSecond"] == min(raw_rounds)
    assert result["ratio"] == round(min(rounds) / min(raw_rounds), 3)
    assert result["baseline"]["commitsPerTask"] >= 2
    assert result["baseline"]["settings"]["synchronous"] == "FULL"
    # The trio thread's own share: part of the process's CPU, busy part of the drive's time.
    for side in ("tritask", "memory"):
        figures = result[side]
        assert 0 < figures["serverThreadCpuMsPerTask"] <= figures["serverCpuMsPerTask"]
        assert 0 < figures["serverThreadBusy"] <= 1
        assert figures["serverGcMsPerTask"] >= 0
        assert 0 <= figures["serverThreadSystemMsPerTask"] <= figures["serverThreadCpuMsPerTask"]
    # The writer process (the sqlite: URL form's default) wrote every creation and settle of
    # the median round, and its CPU is part of the server's.
    writer = result["tritask"]
    assert (writer["writerWritten"], writer["writerUndecided"]) == (40, 0)
    assert 1 <= writer["writerBatches"] <= 40  # one batch in flight: items queue behind it
    assert 0 <= writer["writerCpuMsPerTask"] <= writer["serverCpuMsPerTask"]
    assert result["memory"]["writerWritten"] is None
    assert result["memory"]["writerBatches"] is None
    assert result["memory"]["writerCpuMsPerTask"] is None
    assert isinstance(result["ratio"], float)
    assert isinstance(result["target_met"], bool)


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_tasks_against_another_checkout_smoke() -> None:
    """Each round also runs the other checkout's server (here this one's), on its own fresh
    file; its median round and the ratio to it are reported."""
    result = bench(
        "tasks", "--store", "sqlite:auto", "--tasks", "20", "--clients", "2", "--repeats", "2",
        "--no-raw", "--no-memory", "--against", str(ROOT),
    )  # fmt: skip
    assert result["params"]["against"] == str(ROOT)
    against = result["against"]
    assert (against["completed"], against["sampleStatuses"]) == (20, ["completed"])
    assert len(against["roundsTasksPerSecond"]) == 2
    assert against["storeCalls"] == {"settle": 20, "submit": 20}
    assert 0 < against["serverThreadBusy"] <= 1
    ours, theirs = result["tritask"]["tasksPerSecond"], against["tasksPerSecond"]
    assert result["ratioToAgainst"] == round(ours / theirs, 3)


def test_bench_tasks_against_refuses_what_it_cannot_compare() -> None:
    for argv, message in (
        (["--against", str(ROOT / "no-such-checkout")], "no stress/bench/servers.py there"),
        (["--store", "sqlite:/tmp/kept.db", "--against", str(ROOT)], "sqlite:auto (a fresh file"),
        (
            ["--store", "postgresql://127.0.0.1/x?schema=kept", "--against", str(ROOT)],
            "without ?schema= (a fresh schema per round)",
        ),
        (["--transport", "in-process", "--against", str(ROOT)], "--transport http"),
    ):
        done = python_module("stress", "bench", "tasks", *argv, "--json", timeout=60)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert message in done.stderr


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_tasks_in_process_smoke() -> None:
    """The same app through its dispatcher, no HTTP: figures, but no verdict on the target."""
    result = bench(
        "tasks", "--store", "sqlite:auto", "--tasks", "20", "--clients", "2",
        "--transport", "in-process", "--repeats", "1",
    )  # fmt: skip
    assert result["params"]["transport"] == "in-process"
    assert result["tritask"]["completed"] == 20
    assert result["tritask"]["created"] == 20
    assert result["tritask"]["sampleStatuses"] == ["completed"]
    assert result["tritask"]["storeWritesPerTask"] == 2.0
    assert result["tritask"]["cpuMsPerTask"] > 0
    assert result["baseline"]["commitsPerTask"] == 2
    assert result["target_met"] is None


@pytest.mark.skipif(not (POSTGRES and HAS_POSTGRES), reason="TRITASK_TEST_POSTGRES_DSN is not set")
def test_bench_tasks_against_another_checkout_postgres_smoke() -> None:
    """On PostgreSQL each side's round gets a fresh schema of its own."""
    assert POSTGRES is not None
    result = bench(
        "tasks", "--store", POSTGRES, "--tasks", "20", "--clients", "2", "--repeats", "1",
        "--no-raw", "--no-memory", "--against", str(ROOT),
    )  # fmt: skip
    against = result["against"]
    assert (against["completed"], against["sampleStatuses"]) == (20, ["completed"])
    assert against["storeCalls"] == {"settle": 20, "submit": 20}
    ours, theirs = result["tritask"]["tasksPerSecond"], against["tasksPerSecond"]
    assert result["ratioToAgainst"] == round(ours / theirs, 3)


@pytest.mark.skipif(not (POSTGRES and HAS_POSTGRES), reason="TRITASK_TEST_POSTGRES_DSN is not set")
def test_bench_tasks_and_scale_postgres_smoke() -> None:
    assert POSTGRES is not None
    result = bench(
        "tasks", "--store", POSTGRES, "--tasks", "20", "--clients", "2", "--repeats", "1"
    )
    assert result["tritask"]["completed"] == 20
    assert result["baseline"]["settings"]["synchronous_commit"]
    scale = bench(
        "scale", "--store", POSTGRES, "--tasks", "20", "--clients", "2", "--processes", "1", "2"
    )
    assert scale["name"] == "scale"
    assert set(scale["ratio"]) == {"1", "2"}
    assert scale["tritask"]["2"]["completed"] == 20


def test_bench_soak_smoke() -> None:
    result = bench(
        "soak", "--tasks", "1500", "--checkpoint", "500", "--batch", "250", expect_ok=False
    )
    assert result["name"] == "soak"
    assert result["ok"] is True
    assert result["completed"] == 1500
    assert result["baseline"]["at"] == 500 and result["tritask"]["at"] == 1500
    assert result["baseline"]["peakRssKiB"] > 0 and result["tritask"]["peakRssKiB"] > 0
    assert isinstance(result["ratio"], float)


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_suspended_smoke() -> None:
    result = bench("suspended", "--tasks", "600", "--baseline-tasks", "40", "--seconds", "1")
    assert result["name"] == "suspended"
    assert result["target_met"] is True
    suspended, held = result["tritask"], result["baseline"]
    assert suspended["tasks"] == 600 and held["tasks"] == 40
    assert (suspended["attempts"], suspended["scheduledRetries"]) == (0, 0)
    assert suspended["runnerTrioTasks"] == suspended["runnerTrioTasksBefore"]
    assert suspended["writeCallsDuringIdle"] == 0
    assert suspended["databaseChangedDuringIdle"] is False
    # The baseline's attempts are held: one trio task and a lease each.
    assert held["attempts"] == 40
    assert held["runnerTrioTasks"] == held["runnerTrioTasksBefore"] + 40


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_idle_suspended_is_bench_suspended() -> None:
    """The issue's spelling, ``bench idle --suspended``, runs the same benchmark."""
    result = bench(
        "idle", "--suspended", "--tasks", "300", "--baseline-tasks", "20", "--seconds", "1"
    )
    assert (result["name"], result["target_met"]) == ("suspended", True)
    assert (result["tritask"]["tasks"], result["baseline"]["tasks"]) == (300, 20)
    assert result["tritask"]["writeCallsDuringIdle"] == 0


@pytest.mark.skipif(not HAS_SQLITE, reason="tritask_sqlite is not installed")
def test_bench_queue_smoke() -> None:
    """Four times max_jobs submitted at once: every one accepted (none refused), the queue
    drains, and the server's RSS is reported at both points."""
    result = bench(
        "queue", "--tasks", "400", "--checkpoint", "100", "--clients", "8", "--max-jobs", "4"
    )
    assert result["name"] == "queue"
    assert result["ok"] is True
    figures = result["tritask"]
    assert (figures["accepted"], figures["refused"], figures["completed"]) == (400, 0, 400)
    assert figures["runningAtCheckpoint"] == 4  # the slots hold waiting attempts
    assert figures["drainPerSecond"] > 0 and figures["submitPerSecond"] > 0
    assert result["baseline"]["queued"] == 100 and result["baseline"]["rssKiB"] > 0
    assert result["ratio"] == round(figures["rssKiB"] / result["baseline"]["rssKiB"], 3)


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
def test_bench_idle_sqlite_smoke() -> None:
    """Tasks sleeping in their tools: every one runs through the window, the batch renews them
    all in one store call per heartbeat, the baseline renews each lease alone."""
    result = bench(
        "idle",
        "--store",
        "sqlite:auto",
        "--tasks",
        "24",
        "--clients",
        "3",
        "--seconds",
        "2",
        "--settle-seconds",
        "0.2",
        "--lease-ms",
        "1500",
        "--baseline-tasks",
        "6",
    )
    assert result["name"] == "idle"
    assert result["ok"] is True
    tritask, baseline = result["tritask"], result["baseline"]
    assert (tritask["created"], tritask["runningAtStart"], tritask["runningAtEnd"]) == (24, 24, 24)
    assert tritask["sampleStatuses"] == ["working"]
    assert tritask["heartbeatSeconds"] == 0.5
    assert tritask["renewal"] == "batch (renew_owner)"
    heartbeats = tritask["storeCalls"]["renew_owner"]
    assert 3 <= heartbeats <= 5  # one call per heartbeat in a 2 s window
    assert tritask["leasesRenewed"] == 24 * heartbeats
    assert set(tritask["storeCalls"]) == {"renew_owner"}
    assert tritask["storeCommits"] == heartbeats
    assert result["params"]["commitLimitPerSecond"] == 3.0
    assert baseline["renewal"] == "per attempt"
    assert set(baseline["storeCalls"]) == {"renew"}
    assert baseline["storeCalls"]["renew"] >= 6 * 3
    assert {"serverCpuFractionOfCore", "writeSyscallsPerSecond", "gcSecondsInWindow"} <= set(
        tritask
    )


def test_bench_listen_smoke() -> None:
    """A few streams: every stream gets exactly its task's two pushes, figures are reported
    (the target is judged on the full 10,000-stream run, not here)."""
    result = bench(
        "listen", "--streams", "40", "--tasks", "8", "--baseline-streams", "8",
        "--updates-per-second", "200", expect_ok=False,
    )  # fmt: skip
    assert result["name"] == "listen"
    assert result["errors"] == 0
    for side, streams, tasks in (("baseline", 8, 8), ("tritask", 40, 8)):
        figures = result[side]
        assert (figures["streams"], figures["tasks"]) == (streams, tasks)
        assert figures["streamsFailed"] == 0 and figures["streamsWithWrongStatuses"] == 0
        assert figures["commits"] == 2 * tasks
        assert figures["notifications"] == 2 * streams  # working, then completed, each stream
        assert figures["rssOpenKiB"] > 0 and isinstance(figures["rssPerStreamKiB"], float)
        assert 0 < figures["p50Ms"] <= figures["p99Ms"] <= figures["maxMs"]
    assert set(result["ratio"]) == {"p50", "p99"}
    assert result["targets"] == {"rssPerStreamKiB": 20.0, "p99Ms": 50.0}
    assert isinstance(result["target_met"], bool)


@pytest.mark.parametrize("mode", ["echo", "bare", "floor"])
def test_httploop_smoke(mode: str) -> None:
    done = python_module("stress.bench.httploop", "20", mode)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"20 requests ({mode}): " in done.stderr


@pytest.mark.skipif(not HAS_SQLITE, reason="the SQLite store is not installed")
@pytest.mark.parametrize("kind", ["memory", "sqlite", "writer"])
def test_storeloop_smoke(kind: str) -> None:
    done = python_module("stress.bench.storeloop", "40", kind)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{kind}: " in done.stderr and " of CPU per task" in done.stderr
    if kind == "writer":
        assert "writer wrote 80 and left 0 undecided" in done.stderr


@pytest.mark.skipif(not (POSTGRES and HAS_POSTGRES), reason="TRITASK_TEST_POSTGRES_DSN is not set")
def test_storeloop_postgres_smoke() -> None:
    assert POSTGRES is not None
    done = python_module("stress.bench.storeloop", "40", POSTGRES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "postgresql: " in done.stderr and " of CPU per task" in done.stderr


def test_storeloop_refuses_an_unknown_store() -> None:
    done = python_module("stress.bench.storeloop", "40", "redis://localhost")
    assert done.returncode == 2
    assert "storeloop N [memory|sqlite|writer|postgresql://...]" in done.stderr
