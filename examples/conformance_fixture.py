"""The fixture server for the official MCP conformance suite (2026-07-28, 2025-11-25, 2025-06-18).

Serve it with::

    python -m tritask serve examples/conformance_fixture.py:app --http 127.0.0.1:0 --store memory:

and point ``conformance server --url http://127.0.0.1:PORT/mcp --requirements 2026-07-28`` at it,
or ``--suite all --spec-version 2025-11-25`` (or ``2025-06-18``): one endpoint serves every era.
Tools that ask the client something are written MRTR-style (they return ``input_required``), so
the same code answers a 2026-07-28 client statelessly and a legacy session through
server-initiated requests (``sampling/createMessage``, ``elicitation/create``).

Every tool, prompt, resource and completion the suite calls is here, under the exact names the
scenarios look up. Tools are registered in a fixed order, and ``test_simple_text`` (no required
arguments) comes first, because ``http-header-validation`` calls the first tool of
``tools/list`` with ``arguments: {}``. The Tasks fixtures (``greet``, ``slow_compute``, ...) are
attached at the bottom of this file by the Tasks extension.
"""

from __future__ import annotations

import io
import json
import secrets
import struct
import wave
import zlib
from typing import Annotated, Any

import trio
from conformance_tasks import install_tasks  # a sibling module: examples/ is on sys.path

from tritask.jsonrpc import JSONValue
from tritask.protocol import wire
from tritask.protocol.errors import MissingRequiredClientCapability
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.mrtr import InputRequired, accepted_content, elicitation, list_roots, sampling
from tritask.server.results import ToolError

# -- media ------------------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def tiny_png() -> bytes:
    """A valid 1x1 opaque red PNG (8-bit RGB)."""
    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    scanline = b"\x00\xff\x00\x00"  # filter type 0, then one RGB pixel
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(scanline))
        + _png_chunk(b"IEND", b"")
    )


def tiny_wav() -> bytes:
    """A valid 10 ms, 8 kHz, 16-bit mono PCM WAV of silence."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(8000)
        writer.writeframes(b"\x00\x00" * 80)
    return buffer.getvalue()


PNG = tiny_png()
WAV = tiny_wav()

SIMPLE_TEXT = "This is a simple text response for testing."
ERROR_TEXT = "This tool intentionally returns an error for testing"

app = App(
    "tritask-conformance",
    "0.1.0",
    instructions="Fixture server for the MCP conformance suite.",
    # One process serves the suite, so a per-process key is enough to seal requestState.
    state_key=secrets.token_bytes(32),
)


# -- MRTR helpers ------------------------------------------------------------------------


def _accepted_content(ctx: Context, key: str) -> dict[str, JSONValue] | None:
    """The ``content`` of an accepted elicitation answer for ``key``, if the retry carries one."""
    return accepted_content(ctx.input_response(key))


def _sampled_text(ctx: Context, key: str) -> str | None:
    """The text of a ``CreateMessageResult`` answer for ``key``."""
    answer = ctx.input_response(key)
    if answer is None:
        return None
    content = answer.get("content")
    if isinstance(content, dict) and content.get("type") == "text":
        text = content.get("text")
        return text if isinstance(text, str) else None
    return None


def _root_uris(ctx: Context, key: str) -> list[str] | None:
    """The root URIs of a ``ListRootsResult`` answer for ``key``."""
    answer = ctx.input_response(key)
    if answer is None or not isinstance(answer.get("roots"), list):
        return None
    return [
        root["uri"]
        for root in answer["roots"]
        if isinstance(root, dict) and isinstance(root.get("uri"), str)
    ]


def _string_form(message: str, field: str) -> dict[str, JSONValue]:
    return elicitation(
        message,
        {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]},
    )


def _confirm_form(message: str) -> dict[str, JSONValue]:
    return elicitation(
        message,
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    )


def _question(text: str, max_tokens: int) -> dict[str, JSONValue]:
    return sampling([{"role": "user", "content": {"type": "text", "text": text}}], max_tokens)


# -- core tools (test_simple_text MUST stay first) ---------------------------------------


@app.tool(description="Returns a single text content item.")
async def test_simple_text() -> str:
    return SIMPLE_TEXT


@app.tool(description="Returns a 1x1 PNG image content item.")
async def test_image_content() -> wire.ImageContent:
    return wire.ImageContent.from_bytes(PNG, "image/png")


@app.tool(description="Returns a short WAV audio content item.")
async def test_audio_content() -> wire.AudioContent:
    return wire.AudioContent.from_bytes(WAV, "audio/wav")


@app.tool(description="Returns an embedded text resource.")
async def test_embedded_resource() -> wire.EmbeddedResource:
    return wire.EmbeddedResource(
        resource=wire.TextResourceContents(
            uri="test://embedded-resource",
            mime_type="text/plain",
            text="This is an embedded resource content.",
        )
    )


@app.tool(description="Returns text, an image and an embedded resource together.")
async def test_multiple_content_types() -> list[Any]:
    return [
        wire.text("Multiple content types test:"),
        wire.ImageContent.from_bytes(PNG, "image/png"),
        wire.EmbeddedResource(
            resource=wire.TextResourceContents(
                uri="test://mixed-content-resource",
                mime_type="application/json",
                text=json.dumps({"test": "data", "value": 123}, separators=(",", ":")),
            )
        ),
    ]


@app.tool(
    description="Sends three info log messages (at 2026-07-28 only when the request set a "
    "logLevel; in a legacy session per its logging/setLevel)."
)
async def test_tool_with_logging(ctx: Context) -> str:
    await ctx.log("info", "Tool execution started")
    await trio.sleep(0.05)
    await ctx.log("info", "Tool processing data")
    await trio.sleep(0.05)
    await ctx.log("info", "Tool execution completed")
    return "Logging test completed"


@app.tool(description="Always fails with a tool error (isError: true).")
async def test_error_handling() -> str:
    raise ToolError(ERROR_TEXT)


@app.tool(description="Reports progress 0, 50 and 100 of 100 when called with a progressToken.")
async def test_tool_with_progress(ctx: Context) -> str:
    await ctx.progress(0, 100, "started")
    await trio.sleep(0.05)
    await ctx.progress(50, 100, "halfway")
    await trio.sleep(0.05)
    await ctx.progress(100, 100, "done")
    return "Progress test completed"


@app.tool(description="Requires the sampling client capability: -32021 when it is undeclared.")
async def test_missing_capability(ctx: Context) -> str | InputRequired:
    if not ctx.has_capability("sampling"):
        raise MissingRequiredClientCapability(
            {"sampling": {}}, "test_missing_capability requires the sampling capability"
        )
    answer = _sampled_text(ctx, "probe")
    if answer is None:
        return ctx.input_required({"probe": _question("Say hello.", 20)})
    return f"Sampling answered: {answer}"


@app.tool(description="Asks for confirmation through MRTR; its stream never carries requests.")
async def test_streaming_elicitation(ctx: Context) -> str | InputRequired:
    await ctx.progress(50, 100, "asking")
    content = _accepted_content(ctx, "confirmation")
    if content is None:
        return ctx.input_required({"confirmation": _confirm_form("Continue streaming?")})
    return f"Streaming elicitation complete: ok={content.get('ok')}"


@app.tool(description="Logs at info level; nothing is sent unless the request set a logLevel.")
async def test_logging_tool(ctx: Context) -> str:
    await ctx.log("info", "test_logging_tool was called", logger="conformance")
    return "Logging tool completed"


# -- MRTR tools (SEP-2322) ---------------------------------------------------------------


@app.tool(description="Asks for the user's name through an input_required result.")
async def test_input_required_result_elicitation(ctx: Context) -> str | InputRequired:
    content = _accepted_content(ctx, "user_name")
    name = content.get("name") if content else None
    if not isinstance(name, str):
        return ctx.input_required({"user_name": _string_form("What is your name?", "name")})
    return f"Hello, {name}!"


@app.tool(description="Asks the client's model a question through an input_required result.")
async def test_input_required_result_sampling(ctx: Context) -> str | InputRequired:
    answer = _sampled_text(ctx, "capital_question")
    if answer is None:
        return ctx.input_required(
            {"capital_question": _question("What is the capital of France?", 100)}
        )
    return f"The model answered: {answer}"


@app.tool(description="Asks for the client's roots through an input_required result.")
async def test_input_required_result_list_roots(ctx: Context) -> str | InputRequired:
    roots = _root_uris(ctx, "client_roots")
    if roots is None:
        return ctx.input_required({"client_roots": list_roots()})
    return f"Client roots: {', '.join(roots) or '(none)'}"


@app.tool(description="Round-trips a sealed requestState alongside an elicitation.")
async def test_input_required_result_request_state(ctx: Context) -> str | InputRequired:
    content = _accepted_content(ctx, "confirm")
    state = ctx.request_state
    if content is None or not isinstance(state, dict) or state.get("step") != "confirm":
        return ctx.input_required({"confirm": _confirm_form("Please confirm")}, {"step": "confirm"})
    return f"state-ok: confirmed={content.get('ok')}"


@app.tool(description="Asks for elicitation, sampling and roots in one input_required result.")
async def test_input_required_result_multiple_inputs(ctx: Context) -> str | InputRequired:
    content = _accepted_content(ctx, "user_name")
    name = content.get("name") if content else None
    greeting = _sampled_text(ctx, "greeting")
    roots = _root_uris(ctx, "client_roots")
    state = ctx.request_state
    if isinstance(name, str) and greeting is not None and roots is not None and state:
        return f"{greeting} {name}; roots: {', '.join(roots) or '(none)'}"
    missing: dict[str, dict[str, JSONValue]] = {}
    if not isinstance(name, str):
        missing["user_name"] = _string_form("What is your name?", "name")
    if greeting is None:
        missing["greeting"] = _question("Generate a greeting", 50)
    if roots is None:
        missing["client_roots"] = list_roots()
    if not missing:  # every answer is here but the state is not: ask again from the start
        missing = {
            "user_name": _string_form("What is your name?", "name"),
            "greeting": _question("Generate a greeting", 50),
            "client_roots": list_roots(),
        }
    return ctx.input_required(missing, {"step": "multiple_inputs"})


@app.tool(description="Three rounds: name, then favourite colour, with an evolving requestState.")
async def test_input_required_result_multi_round(ctx: Context) -> str | InputRequired:
    state = ctx.request_state if isinstance(ctx.request_state, dict) else {}
    if state.get("round") == 2 and isinstance(state.get("name"), str):
        content = _accepted_content(ctx, "step2")
        color = content.get("color") if content else None
        if isinstance(color, str):
            return f"{state['name']}'s favorite color is {color}"
        return ctx.input_required(
            {"step2": _string_form("Step 2: What is your favorite color?", "color")}, state
        )
    if state.get("round") == 1:
        content = _accepted_content(ctx, "step1")
        name = content.get("name") if content else None
        if isinstance(name, str):
            return ctx.input_required(
                {"step2": _string_form("Step 2: What is your favorite color?", "color")},
                {"round": 2, "name": name},
            )
    return ctx.input_required(
        {"step1": _string_form("Step 1: What is your name?", "name")}, {"round": 1}
    )


@app.tool(description="Seals its requestState; a tampered state is rejected with -32602.")
async def test_input_required_result_tampered_state(ctx: Context) -> str | InputRequired:
    content = _accepted_content(ctx, "confirm")
    state = ctx.request_state
    if content is None or not isinstance(state, dict) or state.get("step") != "tamper-check":
        return ctx.input_required(
            {"confirm": _confirm_form("Please confirm")}, {"step": "tamper-check"}
        )
    return "state-ok: integrity verified"


@app.tool(description="Only asks for inputs whose client capability this request declared.")
async def test_input_required_result_capabilities(ctx: Context) -> str | InputRequired:
    wanted: dict[str, dict[str, JSONValue]] = {}
    if ctx.has_capability("elicitation"):
        wanted["user_name"] = _string_form("What is your name?", "name")
    if ctx.has_capability("sampling"):
        wanted["capital_question"] = _question("What is the capital of France?", 100)
    if ctx.has_capability("roots"):
        wanted["client_roots"] = list_roots()
    if not wanted:
        return "No input capability declared; nothing to ask."
    missing = {key: request for key, request in wanted.items() if ctx.input_response(key) is None}
    if missing:
        return ctx.input_required(missing)
    return f"Received: {', '.join(sorted(wanted))}"


# -- pending-scenario tools --------------------------------------------------------------

JSON_SCHEMA_2020_12: dict[str, JSONValue] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "addressDef",
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {
        "name": {"type": "string"},
        "address": {"$ref": "#/$defs/address"},
        "contactMethod": {"type": "string", "enum": ["phone", "email"]},
        "phone": {"type": "string"},
        "email": {"type": "string"},
    },
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}


@app.tool(
    name="json_schema_2020_12_tool",
    description="Tool with JSON Schema 2020-12 features",
    input_schema=JSON_SCHEMA_2020_12,
)
async def json_schema_2020_12_tool(**arguments: Any) -> str:
    return f"Received: {json.dumps(arguments, sort_keys=True)}"


CUSTOM_HEADER_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {
        "region": {
            "type": "string",
            "description": "Mirrored into the Mcp-Param-Region header",
            "x-mcp-header": "Region",
        }
    },
    "required": ["region"],
}


@app.tool(
    name="test_custom_header",
    description="Echoes a string argument that clients mirror into the Mcp-Param-Region header.",
    input_schema=CUSTOM_HEADER_SCHEMA,
)
async def test_custom_header(region: str) -> str:
    return f"region={region}"


# -- list-change triggers (subscriptions/listen) -----------------------------------------


async def test_dynamic_tool() -> str:
    return "dynamic tool"


async def test_dynamic_prompt() -> str:
    return "This prompt comes and goes."


@app.tool(description="Adds or removes test_dynamic_tool, so listeners get tools/list_changed.")
async def test_trigger_tool_change(ctx: Context) -> str:
    if "test_dynamic_tool" in ctx.app.tools:
        ctx.app.remove_tool("test_dynamic_tool")
        return "removed test_dynamic_tool"
    ctx.app.add_tool(
        test_dynamic_tool, description="Appears and disappears with test_trigger_tool_change."
    )
    return "added test_dynamic_tool"


@app.tool(description="Adds or removes test_dynamic_prompt, so listeners get prompts/list_changed.")
async def test_trigger_prompt_change(ctx: Context) -> str:
    if "test_dynamic_prompt" in ctx.app.prompts:
        ctx.app.remove_prompt("test_dynamic_prompt")
        return "removed test_dynamic_prompt"
    ctx.app.add_prompt(
        test_dynamic_prompt, description="Appears and disappears with test_trigger_prompt_change."
    )
    return "added test_dynamic_prompt"


# -- initialize-era (2025-06-18, 2025-11-25) scenario tools -----------------------------
#
# Appended after every tool above, so the order the 2026-07-28 scenarios see is unchanged.

USER_INFO_FORM: dict[str, JSONValue] = {
    "type": "object",
    "properties": {
        "username": {"type": "string", "description": "User's response"},
        "email": {"type": "string", "description": "User's email address"},
    },
    "required": ["username", "email"],
}

DEFAULTS_FORM: dict[str, JSONValue] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "Your name", "default": "John Doe"},
        "age": {"type": "integer", "description": "Your age", "default": 30},
        "score": {"type": "number", "description": "Your score", "default": 95.5},
        "status": {
            "type": "string",
            "description": "Your status",
            "enum": ["active", "inactive", "pending"],
            "default": "active",
        },
        "verified": {"type": "boolean", "description": "Verified?", "default": True},
    },
}

ENUMS_FORM: dict[str, JSONValue] = {
    "type": "object",
    "properties": {
        "untitledSingle": {"type": "string", "enum": ["option1", "option2", "option3"]},
        "titledSingle": {
            "type": "string",
            "oneOf": [
                {"const": "value1", "title": "First Option"},
                {"const": "value2", "title": "Second Option"},
                {"const": "value3", "title": "Third Option"},
            ],
        },
        "legacyEnum": {
            "type": "string",
            "enum": ["opt1", "opt2", "opt3"],
            "enumNames": ["Option One", "Option Two", "Option Three"],
        },
        "untitledMulti": {
            "type": "array",
            "items": {"type": "string", "enum": ["option1", "option2", "option3"]},
        },
        "titledMulti": {
            "type": "array",
            "items": {
                "anyOf": [
                    {"const": "value1", "title": "First Choice"},
                    {"const": "value2", "title": "Second Choice"},
                    {"const": "value3", "title": "Third Choice"},
                ]
            },
        },
    },
}


def _elicitation_outcome(ctx: Context, key: str) -> str | None:
    """``action=…, content={…}`` of the client's answer for ``key``, if this round has one."""
    answer = ctx.input_response(key)
    if answer is None:
        return None
    content = answer.get("content")
    return f"action={answer.get('action')}, content={json.dumps(content, sort_keys=True)}"


@app.tool(description="Asks the client's model to answer a prompt (sampling/createMessage).")
async def test_sampling(ctx: Context, prompt: str) -> str | InputRequired:
    answer = _sampled_text(ctx, "completion")
    if answer is None:
        return ctx.input_required({"completion": _question(prompt, 100)})
    return f"LLM response: {answer}"


@app.tool(description="Asks the user for a username and an email address (elicitation/create).")
async def test_elicitation(ctx: Context, message: str) -> str | InputRequired:
    outcome = _elicitation_outcome(ctx, "user_info")
    if outcome is None:
        return ctx.input_required({"user_info": elicitation(message, USER_INFO_FORM)})
    return f"User response: {outcome}"


@app.tool(description="Elicits a form whose every primitive field has a default (SEP-1034).")
async def test_elicitation_sep1034_defaults(ctx: Context) -> str | InputRequired:
    outcome = _elicitation_outcome(ctx, "defaults")
    if outcome is None:
        return ctx.input_required(
            {"defaults": elicitation("Please review the default values", DEFAULTS_FORM)}
        )
    return f"Elicitation completed: {outcome}"


@app.tool(description="Elicits a form with all five enum schema variants (SEP-1330).")
async def test_elicitation_sep1330_enums(ctx: Context) -> str | InputRequired:
    outcome = _elicitation_outcome(ctx, "enums")
    if outcome is None:
        return ctx.input_required({"enums": elicitation("Please pick your options", ENUMS_FORM)})
    return f"Elicitation completed: {outcome}"


@app.tool(
    description="Closes its own SSE stream mid-call and keeps working; the result arrives on "
    "the resumed stream (SSE polling, 2025-11-25)."
)
async def test_reconnection(ctx: Context) -> str:
    await ctx.log("info", "Before disconnect")
    ctx.close_stream()
    await trio.sleep(0.2)
    await ctx.log("info", "After reconnect")
    return "Reconnection test completed"


# -- prompts -----------------------------------------------------------------------------


@app.prompt(description="A simple prompt without arguments.")
async def test_simple_prompt() -> str:
    return "This is a simple prompt for testing."


@app.prompt(description="A prompt with two required arguments.")
async def test_prompt_with_arguments(
    arg1: Annotated[str, "First test argument"], arg2: Annotated[str, "Second test argument"]
) -> str:
    return f"Prompt with arguments: arg1='{arg1}', arg2='{arg2}'"


@app.prompt(description="A prompt that embeds the resource named by resourceUri.")
async def test_prompt_with_embedded_resource(
    resourceUri: Annotated[str, "URI of the resource to embed"],  # the wire name
) -> list[wire.PromptMessage]:
    return [
        wire.PromptMessage(
            role="user",
            content=wire.EmbeddedResource(
                resource=wire.TextResourceContents(
                    uri=resourceUri,
                    mime_type="text/plain",
                    text="Embedded resource content for testing.",
                )
            ),
        ),
        wire.PromptMessage(
            role="user", content=wire.text("Please process the embedded resource above.")
        ),
    ]


@app.prompt(description="A prompt with an image.")
async def test_prompt_with_image() -> list[wire.PromptMessage]:
    return [
        wire.PromptMessage(role="user", content=wire.ImageContent.from_bytes(PNG, "image/png")),
        wire.PromptMessage(role="user", content=wire.text("Please analyze the image above.")),
    ]


@app.prompt(description="Asks which context to use through an input_required result.")
async def test_input_required_result_prompt(ctx: Context) -> str | InputRequired:
    content = _accepted_content(ctx, "user_context")
    context = content.get("context") if content else None
    if not isinstance(context, str):
        return ctx.input_required(
            {"user_context": _string_form("What context should the prompt use?", "context")}
        )
    return f"Use this context: {context}"


# -- resources ---------------------------------------------------------------------------


@app.resource("test://static-text", name="static-text", mime_type="text/plain")
async def static_text() -> str:
    """A static text resource."""
    return "This is the content of the static text resource."


@app.resource("test://static-binary", name="static-binary", mime_type="image/png")
async def static_binary() -> bytes:
    """A static binary resource (a 1x1 PNG)."""
    return PNG


@app.resource("test://template/{id}/data", name="template-data", mime_type="application/json")
async def template_data(id: str) -> str:
    """JSON data for the given id."""
    return json.dumps(
        {"id": id, "templateTest": True, "data": f"Data for ID: {id}"}, separators=(",", ":")
    )


@app.resource("test://watched-resource", name="watched-resource", mime_type="text/plain")
async def watched_resource() -> str:
    """A resource clients subscribe to (resources/subscribe in a legacy session)."""
    return "This resource is watched for updates."


# -- completion --------------------------------------------------------------------------

_ARG1_VALUES = ("paris", "park", "party", "test", "testing")


@app.completion("ref/prompt", "test_prompt_with_arguments")
async def complete_prompt_arguments(
    argument: str, value: str, context: dict[str, str]
) -> list[str]:
    if argument != "arg1":
        return []
    return [candidate for candidate in _ARG1_VALUES if candidate.startswith(value)]


# -- Tasks extension (io.modelcontextprotocol/tasks) -------------------------------------
#
# The tasks fixture tools (greet, slow_compute, failing_job, protocol_error_job,
# confirm_delete, multi_input, test_tool_with_task) come after every core tool, so the order
# above stays unchanged; ``install_tasks`` also attaches the extension.

tasks = install_tasks(app)
