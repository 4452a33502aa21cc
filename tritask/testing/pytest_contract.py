"""A pytest plugin for the reference's ten Tasks contract groups.

Tests give evidence for a group with ``@pytest.mark.contract("tasks-store-hardening")``;
``pytest -m contract`` runs them. The groups named in the ``contract_groups_required`` ini
option (those the landed work covers) must each have at least one passing test whenever the
whole suite (or ``-m contract``) runs, otherwise the session fails: evidence cannot silently
disappear.
"""

from __future__ import annotations

from typing import Final

import pytest

GROUPS: Final[tuple[str, ...]] = (
    "tasks-extension-lifecycle",
    "tasks-extension-races",
    "tasks-extension-http-admission",
    "tasks-extension-subscriptions-http",
    "tasks-extension-subscriptions",
    "tasks-store-hardening",
    "tasks-work-descriptor",
    "tasks-durable-store",
    "tasks-recovery-claims",
    "tasks-retry-policy",
)

_groups_by_node = pytest.StashKey[dict[str, tuple[str, ...]]]()
_passed = pytest.StashKey[set[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "contract_groups_required",
        "contract groups that must have a passing test in a full run",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_groups_by_node] = {}
    config.stash[_passed] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mapping = config.stash[_groups_by_node]
    for item in items:
        groups: list[str] = []
        for marker in item.iter_markers("contract"):
            for group in marker.args:
                if group not in GROUPS:
                    raise pytest.UsageError(f"{item.nodeid}: unknown contract group {group!r}")
                groups.append(group)
        if groups:
            mapping[item.nodeid] = tuple(groups)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed:
        groups = item.config.stash[_groups_by_node].get(item.nodeid, ())
        item.config.stash[_passed].update(groups)


def _full_run(config: pytest.Config) -> bool:
    if config.getoption("keyword", default=""):
        return False
    if config.getoption("ignore", default=None) or config.getoption("deselect", default=None):
        return False
    if config.getoption("exitfirst", default=False):
        return False
    markexpr = config.getoption("markexpr", default="") or ""
    if markexpr and markexpr.strip() != "contract":
        return False
    args = [arg for arg in config.args if not arg.startswith("-")]
    testpaths = config.getini("testpaths") or []
    return (
        not args
        or sorted(args) == sorted(str(config.rootpath / p) for p in testpaths)
        or (sorted(args) == sorted(testpaths))
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    required = [group for group in config.getini("contract_groups_required") if group]
    if not required or not _full_run(config):
        return
    passed = config.stash[_passed]
    missing = [group for group in required if group not in passed]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if missing:
        if reporter is not None:
            reporter.write_line(
                "contract groups without a passing test: " + ", ".join(missing), red=True
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter is not None:
        reporter.write_line(
            f"contract groups with passing evidence: {len(required)}/{len(GROUPS)} required "
            f"({', '.join(required)})"
        )
