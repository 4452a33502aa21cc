"""Run by the FastMCP 4.1.4 + fastmcp-tasks 4.1.4 virtualenv against a tritask server.

``python fastmcp_tasks_driver.py URL FLOW`` runs one flow through the client's public API and
prints one JSON line with what it saw (or ``{"error": ...}``); the test judges the line. Flows:
``follow`` (call_tool on a task tool), ``handle`` (call_tool_task, status, result), ``input``
(an elicitation inside a task answered by the client's handler), ``cancel`` (call_tool_task,
cancel, wait) and ``mrtr_task`` (an MRTR round, then a task).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from fastmcp import Client
from fastmcp_tasks import call_tool_task

ASKED: list[str] = []


async def elicit(message: str, response_type: Any, params: Any, context: Any) -> dict[str, Any]:
    ASKED.append(message)
    properties = (getattr(params, "requested_schema", None) or {}).get("properties", {})
    answer: dict[str, Any] = {}
    if "confirm" in properties:
        answer["confirm"] = True
    if "name" in properties:
        answer["name"] = "Alice"
    return answer


def texts(result: Any) -> list[str]:
    return [block.text for block in result.content if getattr(block, "type", None) == "text"]


async def run(url: str, flow: str) -> dict[str, Any]:
    async with Client(url, elicitation_handler=elicit) as client:
        if flow == "follow":
            result = await client.call_tool("slow_compute", {"seconds": 0.3, "label": "fm"})
            return {"texts": texts(result)}
        if flow == "handle":
            task = await call_tool_task(client, "slow_compute", {"seconds": 0.5, "label": "h"})
            first = await task.status()
            result = await task.result()
            final = await task.status()
            return {
                "task_id": task.task_id,
                "first": first.status,
                "final": final.status,
                "texts": texts(result),
            }
        if flow == "input":
            result = await client.call_tool("confirm_delete", {"filename": "fm.txt"})
            return {"texts": texts(result), "asked": ASKED}
        if flow == "cancel":
            task = await call_tool_task(client, "slow_compute", {"seconds": 60, "label": "c"})
            await task.cancel()
            final = await task.wait(timeout=30)
            return {"final": final.status, "message": final.status_message}
        if flow == "mrtr_task":
            result = await client.call_tool("test_tool_with_task", {})
            return {"texts": texts(result), "asked": ASKED}
    raise SystemExit(f"unknown flow {flow}")


def main() -> None:
    url, flow = sys.argv[1], sys.argv[2]
    try:
        outcome = asyncio.run(run(url, flow))
    except Exception as error:  # the test reports what the client raised
        outcome = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
