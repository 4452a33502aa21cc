"""How the operator commands show tasks: JSON for scripts, aligned tables for people.

Both show bookkeeping, never payloads: argument names but not their values, input keys but not
the requests or answers, error codes and messages but not their data, whether a result exists
but not the result. Output pasted into a ticket must not leak what a tool was given or
returned; the database is there for whoever may read it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from tritask.ops.operations import CancelReport, StoreStatistics
from tritask.tasks._time import format_instant
from tritask.tasks.events import EventKind
from tritask.tasks.model import TaskStatus
from tritask.tasks.store import LedgerEntry, StoredTask, TaskInspection
from tritask.tasks.work import JSONObject

__all__ = [
    "cancel_json",
    "cancel_text",
    "dumps",
    "duration_text",
    "inspection_json",
    "inspection_text",
    "reap_json",
    "statistics_json",
    "statistics_text",
    "table",
    "task_json",
    "tasks_table",
]


def dumps(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False)


def _instant(us: int | None) -> str | None:
    return None if us is None else format_instant(us)


def _error(value: object) -> JSONObject | None:
    """A JSON-RPC error's code and message (its ``data`` may hold anything)."""
    if not isinstance(value, dict):
        return None
    shown: JSONObject = {}
    if isinstance(value.get("code"), int):
        shown["code"] = value["code"]
    if isinstance(value.get("message"), str):
        shown["message"] = value["message"]
    return shown


def task_json(task: StoredTask) -> JSONObject:
    """One task as ``tasks list --json`` shows it (keys in a stable order)."""
    snapshot = task.snapshot
    record = snapshot.task
    claim = task.claim
    return {
        "taskId": record.id,
        "status": record.status.value,
        "statusMessage": record.status_message,
        "tool": task.tool,
        "workType": None if snapshot.work is None else snapshot.work.type,
        "scope": json.loads(task.scope),
        "createdAt": format_instant(record.created_at),
        "lastUpdatedAt": format_instant(record.last_updated_at),
        "expiresAt": _instant(record.expires_at),
        "expired": task.expired,
        "revision": snapshot.revision,
        "retryCount": snapshot.retry_count,
        "retryAt": _instant(snapshot.retry_at),
        "leaseGeneration": task.generation,
        "lease": None
        if claim is None
        else {
            "owner": claim.owner_id,
            "generation": claim.generation,
            "expiresAt": format_instant(claim.expires_at),
            "live": claim.live,
        },
        "inputRequests": sorted(record.input_requests),
        "steps": len(snapshot.steps),
        "suspended": None
        if snapshot.suspended_key is None
        else {"key": snapshot.suspended_key, "until": _instant(snapshot.suspended_until)},
    }


def _argument_names(task: StoredTask) -> list[str] | None:
    work = task.snapshot.work
    if work is None:
        return None
    arguments = work.input.get("arguments") if work.type == "tools/call" else work.input
    return sorted(arguments) if isinstance(arguments, dict) else None


def _ledger_json(entry: LedgerEntry) -> JSONObject:
    event = entry.event
    shown: JSONObject = {
        "revision": entry.revision,
        "committedAt": format_instant(entry.committed_at),
        "kind": event.kind.value,
        "eventId": event.id,
    }
    data = event.data
    if event.kind is EventKind.INPUT_REQUESTED:
        shown["key"] = data["key"]
        shown["method"] = data["request"]["method"]
    elif event.kind is EventKind.INPUT_RESPONSES_ACCEPTED:
        shown["offered"] = sorted(data["responses"])
        shown["accepted"] = sorted(entry.effects.accepted_input_responses or {})
    elif event.kind in (EventKind.RETRY_REQUESTED, EventKind.FAILED):
        shown["statusMessage"] = data["statusMessage"]
        shown["error"] = _error(data["error"])
    elif event.kind is EventKind.STEP_RECORDED:  # the key and whether it failed, no payload
        shown["key"] = data["key"]
        shown["outcome"] = "error" if "error" in data["outcome"] else "result"
    elif event.kind in (EventKind.STEP_STARTED, EventKind.SLEEP_SCHEDULED, EventKind.SUSPENDED):
        shown["key"] = data["key"]
        if event.kind is EventKind.SLEEP_SCHEDULED:
            shown["delayMs"] = data["delayMs"]
    retry = entry.effects.retry
    if retry is not None:
        shown["retry"] = {
            "disposition": retry.disposition,
            "retryAt": _instant(retry.retry_at),
            "delayMs": retry.delay_ms,
            "retryCount": retry.retry_count,
        }
    return shown


def inspection_json(inspection: TaskInspection) -> JSONObject:
    """One task as ``tasks show --json`` shows it: the summary, the details, the ledger."""
    task = inspection.task
    snapshot = task.snapshot
    record = snapshot.task
    failure = snapshot.last_failure
    return {
        "now": format_instant(inspection.now),
        **task_json(task),
        "ttlMs": record.ttl_ms,
        "pollIntervalMs": record.poll_interval_ms,
        "argumentNames": _argument_names(task),
        "input": {
            "requested": sorted(record.input_requests),
            "answered": sorted(snapshot.accepted_input_responses),
            "used": sorted(record.used_input_keys),
        },
        "hasResult": record.result is not None,
        "error": _error(record.error),
        "lastFailure": None
        if failure is None
        else {"statusMessage": failure["statusMessage"], "error": _error(failure["error"])},
        "ledger": [_ledger_json(entry) for entry in inspection.ledger],
    }


def duration_text(us: int) -> str:
    """A short, signed duration: ``45s``, ``3m05s``, ``2h10m``, ``-1.5s``."""
    sign = "-" if us < 0 else ""
    us = abs(us)
    if us < 10_000_000:
        return f"{sign}{us / 1_000_000:.1f}s"
    seconds = us // 1_000_000
    if seconds < 60:
        return f"{sign}{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{sign}{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{sign}{hours}h{minutes:02d}m"
    return f"{sign}{hours // 24}d{hours % 24:02d}h"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    rows = [list(headers), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _lease_text(task: StoredTask, now: int) -> str:
    claim = task.claim
    if claim is None:
        return "-"
    when = duration_text(claim.expires_at - now)
    state = f"expires in {when}" if claim.live else "lapsed"
    return f"{claim.owner_id} gen {claim.generation} {state}"


def tasks_table(tasks: Sequence[StoredTask], now: int) -> str:
    headers = ("TASK", "STATUS", "TOOL", "CREATED", "AGE", "REV", "RETRIES", "LEASE")
    rows = []
    for task in tasks:
        record = task.snapshot.task
        status = record.status.value + (" (expired)" if task.expired else "")
        rows.append(
            (
                record.id,
                status,
                task.tool or "-",
                format_instant(record.created_at),
                duration_text(now - record.created_at),
                str(task.snapshot.revision),
                str(task.snapshot.retry_count),
                _lease_text(task, now),
            )
        )
    return table(headers, rows)


def _event_detail(entry: JSONObject) -> str:
    parts = []
    for key in ("key", "method", "accepted", "statusMessage"):
        value = entry.get(key)
        if value is not None:
            parts.append(f"{key}={','.join(value) if isinstance(value, list) else value}")
    error = entry.get("error")
    if isinstance(error, dict) and error:
        parts.append(f"error={error.get('code')} {error.get('message', '')}".rstrip())
    retry = entry.get("retry")
    if isinstance(retry, dict):
        parts.append(f"retry {retry['disposition']} #{retry['retryCount']}")
        if retry["retryAt"]:
            parts.append(f"at {retry['retryAt']}")
    return " ".join(parts)


def _error_text(error: JSONObject | None) -> str:
    error = error or {}
    return f"{error.get('code')} {error.get('message', '')}".rstrip()


def inspection_text(inspection: TaskInspection) -> str:
    shown = inspection_json(inspection)
    now = inspection.now
    task = inspection.task
    lease = shown["lease"]
    fields: list[tuple[str, Any]] = [
        ("task", shown["taskId"]),
        (
            "status",
            shown["status"] + (" (expired: the next reap deletes it)" if task.expired else ""),
        ),
        ("message", shown["statusMessage"] or "-"),
        ("tool", shown["tool"] or "-"),
        ("work type", shown["workType"] or "-"),
        ("arguments", ", ".join(shown["argumentNames"] or []) or "-"),
        ("scope", json.dumps(shown["scope"], ensure_ascii=False)),
        (
            "created",
            f"{shown['createdAt']} ({duration_text(now - task.snapshot.task.created_at)} ago)",
        ),
        ("updated", shown["lastUpdatedAt"]),
        ("expires", shown["expiresAt"] or "never"),
        ("revision", shown["revision"]),
        ("retries", shown["retryCount"]),
        ("retry at", shown["retryAt"] or "-"),
        ("lease generation", shown["leaseGeneration"]),
        (
            "lease",
            "-"
            if lease is None
            else f"{lease['owner']} gen {lease['generation']} until {lease['expiresAt']} "
            + ("(live)" if lease["live"] else "(lapsed)"),
        ),
        ("input requested", ", ".join(shown["input"]["requested"]) or "-"),
        ("input answered", ", ".join(shown["input"]["answered"]) or "-"),
        ("input keys used", ", ".join(shown["input"]["used"]) or "-"),
    ]
    if shown["error"]:
        fields.append(
            ("error", f"{shown['error'].get('code')} {shown['error'].get('message', '')}")
        )
    if shown["lastFailure"]:
        failure = shown["lastFailure"]
        error = failure["error"] or {}
        fields.append(
            (
                "last failure",
                f"{error.get('code')} {error.get('message', '')} ({failure['statusMessage']})",
            )
        )
    width = max(len(name) for name, _ in fields)
    lines = [f"{name.ljust(width)}  {value}" for name, value in fields]
    ledger = shown["ledger"]
    lines.append("")
    if ledger:
        lines.append(
            table(
                ("REV", "COMMITTED", "EVENT", "DETAIL"),
                (
                    (str(e["revision"]), e["committedAt"], e["kind"], _event_detail(e))
                    for e in ledger
                ),
            )
        )
    else:
        lines.append("no events yet (revision 0)")
    return "\n".join(lines)


def cancel_json(report: CancelReport) -> JSONObject:
    return {
        "taskId": report.task_id,
        "outcome": report.outcome.value,
        "status": None if report.status is None else report.status.value,
        "revision": report.revision,
    }


def cancel_text(report: CancelReport) -> str:
    outcome = report.outcome.value
    if outcome == "cancelled":
        return f"cancelled task {report.task_id} (revision {report.revision})"
    if outcome == "already_terminal":
        status = report.status.value if report.status else "terminal"
        return f"task {report.task_id} is already {status}: nothing to cancel"
    if outcome == "expired":
        return f"task {report.task_id} has expired (the next reap deletes it): nothing to cancel"
    return f"no task {report.task_id} in this store"


def statistics_json(stats: StoreStatistics, expiring_within_ms: int) -> JSONObject:
    def brief(task: StoredTask) -> JSONObject:
        summary = task_json(task)
        return {key: summary[key] for key in ("taskId", "status", "tool", "createdAt", "lease")}

    oldest = stats.oldest_active
    return {
        "now": format_instant(stats.now),
        "total": stats.total,
        "byStatus": {status.value: count for status, count in stats.by_status.items()},
        "byTool": [
            {"tool": tool, "byStatus": {s.value: counts.get(s, 0) for s in TaskStatus}}
            for tool, counts in sorted(stats.by_tool.items(), key=lambda item: item[0] or "")
        ],
        "oldestActive": None
        if oldest is None
        else {**brief(oldest), "ageMs": (stats.now - oldest.snapshot.task.created_at) // 1000},
        "expiringWithinMs": expiring_within_ms,
        "leasesExpiring": [brief(task) for task in stats.expiring],
        "leasesLapsed": [brief(task) for task in stats.lapsed],
        "retrying": stats.retrying,
        "expired": stats.expired,
    }


def statistics_text(stats: StoreStatistics, expiring_within_ms: int) -> str:
    now = stats.now
    counts = ", ".join(f"{status.value} {count}" for status, count in stats.by_status.items())
    lines = [f"tasks: {stats.total} ({counts}) at {format_instant(now)}"]
    if stats.by_tool:
        lines.append("")
        lines.append(
            table(
                ("TOOL", *(status.value.upper() for status in TaskStatus)),
                (
                    (tool or "-", *(str(counts_.get(s, 0)) for s in TaskStatus))
                    for tool, counts_ in sorted(stats.by_tool.items(), key=lambda i: i[0] or "")
                ),
            )
        )
    lines.append("")
    oldest = stats.oldest_active
    if oldest is None:
        lines.append("oldest active task: none")
    else:
        age = duration_text(now - oldest.snapshot.task.created_at)
        lines.append(
            f"oldest active task: {oldest.task_id} ({oldest.tool or '-'}, "
            f"{oldest.snapshot.task.status.value}, {age} old)"
        )
    lines.append(f"retries scheduled: {stats.retrying}")
    lines.append(f"expired, awaiting reap: {stats.expired}")
    window = duration_text(expiring_within_ms * 1000)
    lines.append(f"leases expiring within {window}: {len(stats.expiring)}")
    lines.extend(f"  {t.task_id}  {_lease_text(t, now)}" for t in stats.expiring)
    lines.append(f"lapsed leases (awaiting recovery): {len(stats.lapsed)}")
    lines.extend(f"  {t.task_id}  {_lease_text(t, now)}" for t in stats.lapsed)
    return "\n".join(lines)


def reap_json(reaped: Sequence[str]) -> JSONObject:
    return {"reaped": list(reaped), "count": len(reaped)}
