"""Peers for ``bench tasks --peer``: other task runtimes driven by the same load generator.

``fastmcp-tasks``: FastMCP 4.1.4 with fastmcp-tasks 4.1.4 on Docket's ``memory://`` backend
(:mod:`stress.bench.peer_fastmcp`). Its dependencies conflict with the project's, so it runs
from the virtualenv the interop test pins (``tests/interop/fastmcp-tasks-requirements.txt``),
under ``.cache/venvs/fastmcp-tasks-<digest>`` (the same directory, so it is made once for
both). :func:`peer_python` makes it if it is missing (``pip install --no-deps`` of the pinned
files) and says why when it cannot.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import venv
from pathlib import Path

__all__ = ["PEERS", "PeerUnavailable", "peer_argv"]

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "tests" / "interop" / "fastmcp-tasks-requirements.txt"
VENVS = REPO / ".cache" / "venvs"
PEERS = ("fastmcp-tasks",)


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (its virtualenv could not be made)."""


def _fastmcp_python() -> Path:
    if not REQUIREMENTS.is_file():
        raise PeerUnavailable(f"{REQUIREMENTS} is missing (run from a checkout)")
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    home = VENVS / f"fastmcp-tasks-{digest}"
    python = home / "bin" / "python"
    done = home / ".installed"
    if done.exists():
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    with (VENVS / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        venv.EnvBuilder(with_pip=True, clear=True).create(home)
        completed = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-deps", "-r", str(REQUIREMENTS)],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if completed.returncode != 0:
            raise PeerUnavailable(f"installing fastmcp-tasks failed: {completed.stderr[-2000:]}")
        done.write_text(digest + "\n", "utf-8")
    return python


def peer_argv(name: str) -> list[str]:
    """The command that serves ``name`` (prints ``READY <port>``, stops when stdin closes)."""
    if name != "fastmcp-tasks":
        raise PeerUnavailable(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    return [str(_fastmcp_python()), str(Path(__file__).with_name("peer_fastmcp.py"))]
