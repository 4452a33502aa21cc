"""The dependency direction of docs/architecture.md, enforced by import-linter.

The contracts live in pyproject.toml (``[tool.importlinter]``). One test checks the real tree;
the other proves the check can fail: a copy of the tree with one forbidden import added must be
reported broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'stores'}"}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports;"
            " sys.exit(lint_imports(no_cache=True, no_logo=True))",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_tree_keeps_every_contract() -> None:
    completed = lint_imports(ROOT)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Contracts: 13 kept, 0 broken." in completed.stdout


@pytest.mark.parametrize(
    ("module", "added", "report"),
    [
        (
            "hub.py",
            "import tritask.tasks.model",
            ("Contracts: 11 kept, 2 broken.", "tritask.server.hub -> tritask.tasks.model"),
        ),
        (
            "app.py",
            "from tritask.server.dispatcher import Dispatcher",
            ("Contracts: 12 kept, 1 broken.", "tritask.server.app -> tritask.server.dispatcher"),
        ),
        (
            "context.py",
            "import tritask.auth.bearer",
            ("Contracts: 12 kept, 1 broken.", "tritask.server.context -> tritask.auth.bearer"),
        ),
    ],
    ids=["server-imports-tasks", "app-builds-a-dispatcher", "server-imports-oauth"],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, added: str, report: tuple[str, str]
) -> None:
    shutil.copytree(
        ROOT / "tritask", tmp_path / "tritask", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(
        ROOT / "stores", tmp_path / "stores", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    source = tmp_path / "tritask" / "server" / module
    source.write_text(source.read_text("utf-8") + f"\n{added}  # noqa\n", "utf-8")
    completed = lint_imports(tmp_path)
    assert completed.returncode == 1, completed.stdout
    for line in report:
        assert line in completed.stdout


def test_joserfc_is_imported_only_when_a_jwt_is_verified() -> None:
    """``tritask[oauth]`` is optional: importing tritask, its HTTP transport and tritask.auth
    loads no JOSE library (the CLI and an app without OAuth work without the extra)."""
    code = (
        "import sys, tritask, tritask.transports.http, tritask.auth, tritask.cli;"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('joserfc', 'jwt')))"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'stores'}"}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert completed.stdout.strip() == "[]"
