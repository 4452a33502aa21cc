"""``tritask serve`` refuses an app it cannot load with one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BROKEN = {
    "no_description.py": (
        "from tritask import App\n"
        "app = App('broken', '1')\n"
        "@app.tool\n"
        "async def undocumented() -> str:\n"
        "    return ''\n",
        "tritask: cannot load {path}:app: ValueError: tool 'undocumented' needs a description"
        " (argument or docstring)",
    ),
    "raises.py": (
        "raise RuntimeError('the config is missing')\n",
        "tritask: cannot load {path}:app: RuntimeError: the config is missing",
    ),
    "not_an_app.py": ("app = 42\n", "tritask: {path}:app is not a tritask.App"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_loading_errors_are_one_line(tmp_path: Path, name: str) -> None:
    source, expected = BROKEN[name]
    path = tmp_path / name
    path.write_text(source, "utf-8")
    completed = subprocess.run(
        [sys.executable, "-m", "tritask", "serve", f"{path}:app", "--stdio", "--store", "memory:"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stdout == ""
    assert completed.stderr.strip().splitlines() == [expected.format(path=path)]
