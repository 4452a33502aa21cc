"""Driving a ``Fuzzer`` with Hypothesis from a trio program (the tests and ``stress fuzz``).

Hypothesis runs its examples synchronously, so they run in a worker thread and each step is
sent with ``trio.from_thread.run`` on the trio loop that owns the driver. An example draws its
steps one at a time (``st.data()``), so a step can use the task ids and input keys the answers
to the steps before it revealed; an example that records a new violation fails, and Hypothesis
shrinks it (the server's state carries over between examples, so a shrunk example is a strong
hint, not always a standalone reproduction).
"""

from __future__ import annotations

from typing import Any

import hypothesis
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from stress.fuzz.session import Fuzzer
from stress.fuzz.strategies import steps

SUPPRESSED = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
]


async def fuzz(
    fuzzer: Fuzzer,
    *,
    examples: int,
    max_steps: int = 3,
    shrink: bool = True,
    seed: int | None = None,
    fail_fast: bool = True,
) -> None:
    """Discover the app, run ``examples`` examples (or until the budget), settle the tasks.

    With ``fail_fast`` an example that records a violation fails (and is shrunk); without it
    every violation is only recorded, for a report of the whole run.
    """
    await fuzzer.open()
    await fuzzer.discover()
    await fuzzer.tour()

    def run_examples() -> None:
        phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=phases,
            suppress_health_check=SUPPRESSED,
            print_blob=False,
        )
        @given(st.data())
        def example(data: Any) -> None:
            before = len(fuzzer.ledger.violations)
            for _ in range(data.draw(st.integers(min_value=1, max_value=max_steps), "steps")):
                step = data.draw(steps(fuzzer.catalogue, fuzzer.pool, legacy=fuzzer.legacy))
                if not fuzzer.exhausted:  # drawn all the same: the choices keep their meaning
                    trio.from_thread.run(fuzzer.run, step)
            found = fuzzer.ledger.violations[before:]
            assert not (found and fail_fast), "\n".join(found)

        if seed is not None:
            example = hypothesis.seed(seed)(example)
        example()

    await trio.to_thread.run_sync(run_examples)
    await fuzzer.settle()
    await fuzzer.alive()
