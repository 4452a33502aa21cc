"""``tritask serve`` refuses an app it cannot load or serve with one line, never a traceback.

A configuration refused at start (``ConfigurationError``) opens no store: the SQLite file the
command would have used is never created.
"""

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
    "misspelt_policy.py": (
        "from tritask import App, Tasks\n"
        "app = App('misspelt', '1', extensions=[Tasks(task_support={'exprt': 'required'})])\n"
        "@app.tool\n"
        "async def export() -> str:\n"
        "    'Export.'\n"
        "    return ''\n",
        "tritask: cannot serve {path}:app: Tasks(task_support=...): tool 'exprt' is unknown"
        " (did you mean 'export'?); known: 'export'",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_loading_errors_are_one_line(tmp_path: Path, name: str) -> None:
    source, expected = BROKEN[name]
    path = tmp_path / name
    path.write_text(source, "utf-8")
    database = tmp_path / "tasks.db"
    store = f"sqlite:{database}"
    completed = subprocess.run(
        [sys.executable, "-m", "tritask", "serve", f"{path}:app", "--stdio", "--store", store],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stdout == ""
    assert completed.stderr.strip().splitlines() == [expected.format(path=path)]
    assert not database.exists()
