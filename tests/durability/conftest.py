"""The durability tests share the PostgreSQL fixtures of the store tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "stores"))
