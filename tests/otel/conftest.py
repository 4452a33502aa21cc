"""The durable-store tests here use the PostgreSQL fixtures of ``tests/stores``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "stores"))
