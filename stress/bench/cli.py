"""Registration of the ``bench`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def register_bench(commands: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = commands.add_parser("bench", help="benchmarks with their baselines")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    del kinds, common
