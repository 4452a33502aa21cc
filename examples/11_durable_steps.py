"""Durable steps: a refund that survives being killed (SIGKILL, twice) and never refunds twice.

Run it: ``python examples/11_durable_steps.py [DIR]``. The refund tool loads the invoice,
refunds it at a payment provider (a file standing in for Stripe, which deduplicates by
idempotency key), asks an operator to confirm, notifies each invoice line, and closes the ticket
after a durable cool-down. Each step's outcome is recorded in the task's store (SQLite) before
the tool goes on, so a recovered attempt replays what is done and runs only what is not.

The story: a real ``tritask serve`` process is killed right after the provider refunded but
before the charge step was recorded (the one window where a step runs again: its body runs a
second time, with the same ``ctx.step_key``, and the provider answers with the first refund);
killed again while the task waits for the confirmation (suspended: no worker holds it); then the
operator answers through a third server, and the task completes: one refund, each line notified
once, the load run once.

Semantics in one line: each step runs at least once, and its recording happens exactly once;
hand ``ctx.step_key(key)`` to anything outside that can deduplicate.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from tritask import App, Context, Tasks, elicitation

if TYPE_CHECKING:
    from tritask.testing import ServeProcess
    from tritask.testing.client import Client, HttpTransport

# -- the service (what `tritask serve examples/11_durable_steps.py:app` runs) ----------------

DATA = Path(os.environ.get("REFUND_EXAMPLE_DIR", "."))
INVOICES = {
    "A-1001": {
        "customer": "ada@example.com",
        "total": 4200,
        "lines": [{"sku": "book", "amount": 3000}, {"sku": "shipping", "amount": 1200}],
    }
}
CONFIRM = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _append(name: str, record: dict[str, Any]) -> None:
    """Append one JSON line, fsynced: the example's side effects, in their real order."""
    fd = os.open(DATA / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _lines(name: str) -> list[dict[str, Any]]:
    path = DATA / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _provider_refund(amount: int, idempotency_key: str) -> str:
    """The payment provider: a repeated idempotency key gets the first refund back."""
    _append("calls.jsonl", {"call": "refund", "key": idempotency_key})
    for refund in _lines("provider.jsonl"):
        if refund["key"] == idempotency_key:
            return str(refund["id"])
    refund_id = f"re_{len(_lines('provider.jsonl')) + 1}"
    _append("provider.jsonl", {"id": refund_id, "key": idempotency_key, "amount": amount})
    return refund_id


async def load_invoice(order: str) -> dict[str, Any]:
    await trio.to_thread.run_sync(_append, "calls.jsonl", {"call": "load", "key": order})
    return INVOICES[order]


async def charge(amount: int, idempotency_key: str) -> str:
    refund_id = await trio.to_thread.run_sync(_provider_refund, amount, idempotency_key)
    if os.environ.get("REFUND_EXAMPLE_SLOW_CHARGE") == "1":
        await trio.sleep(30)  # the first server is killed here: refunded, not yet recorded
    return refund_id


async def notify(line: dict[str, Any], refund_id: str, idempotency_key: str) -> None:
    record = {"call": "notify", "key": idempotency_key, "sku": line["sku"], "refund": refund_id}
    await trio.to_thread.run_sync(_append, "calls.jsonl", record)


app = App("example-11", "0.1.0")


@app.tool()
async def refund(ctx: Context, order: str) -> dict[str, Any]:
    """Refund an order: load, refund, confirm, notify each line, cool down, close."""
    invoice = await ctx.step("load", load_invoice, order)
    refund_id = await ctx.step("charge", charge, invoice["total"], ctx.step_key("charge"))
    answer = await ctx.await_input(
        "confirm",
        elicitation(f"Refunded {invoice['total']} to {invoice['customer']}: confirm?", CONFIRM),
    )
    confirmed = answer.get("action") == "accept" and answer.get("content", {}).get("ok") is True
    for index, line in enumerate(invoice["lines"]):
        key = f"notify/{index}"
        await ctx.step(key, notify, line, refund_id, ctx.step_key(key))
    await ctx.sleep("cooldown", 2)  # durable: a replay sleeps only what is left
    return {"order": order, "refund": refund_id, "confirmed": confirmed}


app.add_extension(
    Tasks(
        task_support={"refund": "required"},
        poll_interval_ms=50,
        runner_options={
            "lease_ms": 2_000,
            "recovery_interval_ms": 100,
            "suspend_sleep_after_ms": 500,  # the 2 s cool-down suspends the task
            "suspend_input_after_ms": 500,  # so does waiting for the operator
        },
    )
)

# -- the story (the parent process: starts, kills and restarts the server) -------------------


def server(directory: Path, *, slow_charge: bool) -> ServeProcess:
    """A real ``tritask serve`` of this file on ``directory/refunds.db`` (``async with`` starts
    it and waits until it has printed its URL; leaving the block always ends it)."""
    from tritask.testing import ServeProcess  # the parent's only: the served app needs none

    env = {
        **os.environ,
        "REFUND_EXAMPLE_DIR": str(directory),
        "REFUND_EXAMPLE_SLOW_CHARGE": "1" if slow_charge else "0",
    }
    return ServeProcess(
        f"{Path(__file__).resolve()}:app",
        store=f"sqlite:{directory / 'refunds.db'}",
        env=env,
        args=("--log-level", "ERROR"),
    )


def client_of(served: ServeProcess) -> tuple[Client, HttpTransport]:
    from tritask.testing.client import Client, HttpTransport

    transport = HttpTransport(served.url)
    return Client(transport, capabilities={"elicitation": {}}), transport


async def wait_for(probe: Any, what: str, seconds: float = 60) -> Any:
    with trio.fail_after(seconds):
        while True:
            value = await probe()
            if value:
                return value
            await trio.sleep(0.05)
    raise AssertionError(what)


async def main(directory: Path) -> None:
    global DATA
    DATA = directory
    async with server(directory, slow_charge=True) as first:
        client, transport = client_of(first)
        created = await client.call_tool("refund", {"order": "A-1001"})
        task_id = created["taskId"]
        assert created["resultType"] == "task" and isinstance(task_id, str)
        print("1. refund task", task_id, "created")

        async def refunded() -> bool:
            return bool(_lines("provider.jsonl"))

        await wait_for(refunded, "the provider never refunded")
        await first.akill()
        await transport.aclose()
    print("2. killed after the provider refunded, before the charge step was recorded")

    async with server(directory, slow_charge=False) as second:
        client, transport = client_of(second)

        async def asked() -> bool:
            task = await client.get_task(task_id)
            return bool(task["status"] == "input_required")

        await wait_for(asked, "the confirmation was never asked")
        await trio.sleep(1.0)  # past suspend_input_after_ms: suspended, no worker holds it
        await second.akill()
        await transport.aclose()
    print("3. killed again while the task waited (suspended) for the operator's confirmation")

    async with server(directory, slow_charge=False) as third:
        client, transport = client_of(third)
        task = await client.get_task(task_id)
        assert task["status"] == "input_required", task
        await client.update_task(
            task_id, {"confirm": {"action": "accept", "content": {"ok": True}}}
        )
        print("4. the operator confirmed through the third server")
        done = await client.wait_task(task_id, poll_seconds=0.05)
        await transport.aclose()
        assert await third.astop() == 0, third.stderr
    assert done["status"] == "completed", done
    result = done["result"]
    assert isinstance(result, dict)
    outcome = result["structuredContent"]
    assert outcome == {"order": "A-1001", "refund": "re_1", "confirmed": True}, outcome

    calls = _lines("calls.jsonl")
    counts = Counter(call["call"] for call in calls)
    provider = _lines("provider.jsonl")
    charge_keys = {call["key"] for call in calls if call["call"] == "refund"}
    assert charge_keys == {f"{task_id}/charge"}  # the same step_key both times
    assert counts == {"load": 1, "refund": 2, "notify": 2}, counts
    assert [(r["id"], r["amount"]) for r in provider] == [("re_1", 4200)]
    notified = [call["sku"] for call in calls if call["call"] == "notify"]
    assert notified == ["book", "shipping"]
    print(
        "5. completed:",
        outcome,
        f"- the charge body ran {counts['refund']} times with one step_key, the provider "
        f"refunded {len(provider)} time; load ran {counts['load']} time, each line was "
        "notified once",
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        target = Path(sys.argv[1])
        target.mkdir(parents=True, exist_ok=True)
        trio.run(main, target)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(main, Path(tmp))
