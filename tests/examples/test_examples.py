"""Every walkthrough in examples/ runs to completion (each asserts its own story)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SUBSCRIPTIONS_STORY = [
    "2. listening to 3 tasks",
    "    deploy: input_required (asks: Deploy api to production?)",
    "3. answered deploy's confirmation",
    "    deploy: completed -> api deployed",
    "5. terminal: build_report completed, deploy completed, watch_queue cancelled",
]
"""Printed in this order (other lines interleave as the notifications race)."""

ORDERED = frozenset({"17_tasks_subscriptions.py", "17_tasks_subscriptions.py ws"})

CASES = {
    "01_first_server.py": ["add(2, 40) = 42"],
    "02_runner_without_mcp.py": [
        "2. the first runner stopped; the task waits in jobs.db",
        "4. same idempotency key, generation 1 then 2",
    ],
    "07_tasks_memory.py": ["1. without the declaration: -32021", "5. cancelled: cancelled"],
    "08_tasks_durable.py": [
        "3. the request's credential is in none of the store's files",
        "4. recovered at generation 2 and completed",
    ],
    "10_tasks_postgres.py": [
        "4. host B adopted it at generation 2 (woken by NOTIFY)",
        "5. completed: report built on host B",
    ],
    "11_durable_steps.py": [
        "2. killed after the provider refunded, before the charge step was recorded",
        "3. killed again while the task waited (suspended) for the operator's confirmation",
        "5. completed: {'confirmed': True, 'order': 'A-1001', 'refund': 're_1'} - the charge "
        "body ran 2 times with one step_key, the provider refunded 1 time; load ran 1 time, "
        "each line was notified once",
    ],
    "17_tasks_subscriptions.py": SUBSCRIPTIONS_STORY,
    "17_tasks_subscriptions.py ws": SUBSCRIPTIONS_STORY,
    "09_tasks_retry.py": [
        "1. attempt 1 asked for a retry; retry_at = 2026-08-25T10:01:00.001Z",
        "4. retry_count 1, retry_at cleared, executor ran twice with one idempotency key",
    ],
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if group is None else pytest.mark.contract(group))
        for name, group in [
            ("01_first_server.py", None),
            ("02_runner_without_mcp.py", "tasks-recovery-claims"),
            ("07_tasks_memory.py", "tasks-extension-lifecycle"),
            ("08_tasks_durable.py", "tasks-work-descriptor"),
            ("09_tasks_retry.py", "tasks-retry-policy"),
            ("10_tasks_postgres.py", "tasks-recovery-claims"),
            ("11_durable_steps.py", None),
            ("17_tasks_subscriptions.py", "tasks-extension-subscriptions-http"),
            ("17_tasks_subscriptions.py ws", "tasks-extension-subscriptions"),
        ]
    ],
)
def test_example_runs(name: str) -> None:
    script, *extra = name.split(" ")
    args = [sys.executable, str(EXAMPLES / script), *extra]
    if name.startswith("10_"):
        dsn = os.environ.get("TRITASK_TEST_POSTGRES_DSN")
        if not dsn:
            if os.environ.get("TRITASK_REQUIRE_POSTGRES") == "1":
                pytest.fail("TRITASK_REQUIRE_POSTGRES=1 but TRITASK_TEST_POSTGRES_DSN is unset")
            pytest.skip("PostgreSQL example: set TRITASK_TEST_POSTGRES_DSN")
        args.append(dsn)
    completed = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for line in CASES[name]:
        assert line in completed.stdout, completed.stdout
    if name in ORDERED:
        printed = completed.stdout.splitlines()
        positions = [printed.index(line) for line in CASES[name]]
        assert positions == sorted(positions), completed.stdout
        assert "    watch_queue: cancelled" in printed, completed.stdout
