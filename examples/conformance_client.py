"""The tritask client under the official conformance suite's client scenarios.

The suite runs ``python examples/conformance_client.py <server URL>`` with the scenario named
in ``MCP_CONFORMANCE_SCENARIO`` (and, for some, arguments in ``MCP_CONFORMANCE_CONTEXT``),
and judges what the client sent. Every scenario uses the public ``tritask.client`` API only;
what a scenario exercises (MRTR echo rules, routing and ``Mcp-Param-*`` headers, rejected
tool definitions, version retry) is the client's ordinary behaviour, nothing is special-cased.

    node <suite>/dist/index.js client --command "python examples/conformance_client.py" \\
        --requirements 2026-07-28
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from tritask.client import Client, InputRequest, connect

log = logging.getLogger("conformance_client")

Scenario = Callable[[Client], Awaitable[None]]


def sample_value(schema: Mapping[str, Any]) -> Any:
    """A value that fits a simple JSON schema (enough for the suite's tools)."""
    if "default" in schema:
        return schema["default"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return sample_arguments(schema)
    return "test"


def sample_arguments(schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    return {
        name: sample_value(properties.get(name) or {}) for name in required if isinstance(name, str)
    }


async def accept_elicitation(request: InputRequest) -> dict[str, Any]:
    """Accept with a value for every requested field."""
    schema = request.params.get("requestedSchema") or {}
    content = {
        name: sample_value(field) if field.get("type") != "boolean" else True
        for name, field in (schema.get("properties") or {}).items()
        if isinstance(field, dict)
    }
    return {"action": "accept", "content": content}


async def answer_sampling(request: InputRequest) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": {"type": "text", "text": "conformance answer"},
        "model": "conformance-model",
        "stopReason": "endTurn",
    }


ROOTS = [{"uri": "file:///tmp/conformance", "name": "conformance"}]


async def call_every_tool(client: Client) -> None:
    """List the tools and call each one the client kept, with arguments that fit it."""
    for tool in await client.list_tools():
        result = await client.call_tool(tool.name, sample_arguments(tool.input_schema))
        log.info("%s -> %s", tool.name, result.text[:80])


async def every_surface(client: Client) -> None:
    """Tools, resources and prompts: every method that carries routing headers."""
    await call_every_tool(client)
    for resource in await client.list_resources():
        await client.read_resource(str(resource["uri"]))
    for prompt in await client.list_prompts():
        arguments = {
            str(argument["name"]): "test"
            for argument in prompt.get("arguments") or []
            if isinstance(argument, dict) and argument.get("required")
        }
        await client.get_prompt(str(prompt["name"]), arguments)


async def context_tool_calls(client: Client) -> None:
    """Call the tools the scenario's context names, with the context's arguments verbatim."""
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    await client.list_tools()
    for call in context.get("toolCalls") or []:
        await client.call_tool(call["name"], call.get("arguments") or {})


async def mrtr_request_state(client: Client) -> None:
    """The MRTR tools one after another, with an unrelated call between the rounds' tools."""
    names = [tool.name for tool in await client.list_tools()]
    for name in ("test_mrtr_echo_state", "test_mrtr_unrelated", "test_mrtr_no_state"):
        if name in names:
            await client.call_tool(name)
    if "test_mrtr_no_result_type" in names:
        await client.call_tool("test_mrtr_no_result_type")


async def list_only(client: Client) -> None:
    await client.list_tools()


SCENARIOS: dict[str, Scenario] = {
    "tools_call": call_every_tool,
    "request-metadata": call_every_tool,
    "sep-2322-client-request-state": mrtr_request_state,
    "http-standard-headers": every_surface,
    "http-custom-headers": context_tool_calls,
    "http-invalid-tool-headers": call_every_tool,
    "json-schema-ref-no-deref": list_only,
}


async def main(url: str, scenario: str) -> int:
    run = SCENARIOS.get(scenario)
    if run is None:
        print(f"conformance_client: scenario {scenario!r} is not supported", file=sys.stderr)
        return 2
    async with connect(
        url,
        elicitation=accept_elicitation,
        sampling=answer_sampling,
        roots=ROOTS,
        client_info={"name": "tritask-conformance-client", "version": "0.1.0"},
    ) as client:
        await run(client)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if len(sys.argv) < 2:
        raise SystemExit("usage: conformance_client.py SERVER_URL")
    scenario_name = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
    sys.exit(trio.run(main, sys.argv[-1], scenario_name))
