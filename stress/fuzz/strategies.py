"""Hypothesis strategies for the parameters of every method, driven by what the app lists.

Arguments start from a tool's advertised ``inputSchema`` (a value of the right type for each
property, most of the time) and are then bent: a property dropped, one of the wrong type, a
name the tool never declared, the whole object replaced by junk. Input responses answer the
keys the server really asked for (``Pool.input_keys``) with well-formed and malformed answers.
Task ids come from tasks the server really created (``Pool.task_ids``).

The values stay in what a JSON peer can send: no lone surrogates (a client cannot encode them
in UTF-8), and numbers beyond a double only rarely (the server refuses those as a parse
error, which the checks accept).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any, Final

import attrs
from hypothesis import strategies as st

from stress.fuzz.eras import TASKS_EXTENSION

Draw = st.DrawFn

_TEXT: Final = st.text(max_size=12)
_NAMES: Final = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=10)

json_scalars: Final = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-1000, max_value=1000)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False, width=64)
    | _TEXT
)
json_values: Final = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
json_objects: Final = st.dictionaries(_TEXT, json_values, max_size=4)
out_of_range: Final = st.sampled_from([10**400, -(10**309), 2**1024])
"""Integers no double holds (the wire refuses them: issue 18's ``1e400`` class)."""


@attrs.define
class Pool:
    """What the server has shown so far: task ids, the input keys it asked for, sealed states."""

    task_ids: list[str] = attrs.field(factory=list)
    task_tools: list[str] = attrs.field(factory=list)
    """Tools whose calls became tasks (drawn more often: tasks are where state lives)."""
    input_keys: list[str] = attrs.field(factory=list)
    states: list[tuple[str, str]] = attrs.field(factory=list)
    """(tool name, requestState) pairs from input_required answers."""

    def add_key(self, key: str) -> None:
        if key not in self.input_keys and len(self.input_keys) < 64:
            self.input_keys.append(key)


@attrs.frozen
class Catalogue:
    """The app as its lists describe it."""

    tools: Mapping[str, Mapping[str, Any]]
    """Tool name to its inputSchema."""
    prompts: Mapping[str, tuple[str, ...]]
    """Prompt name to its argument names."""
    resources: tuple[str, ...]
    templates: tuple[str, ...]

    def param_headers(self, tool: str) -> dict[str, str]:
        """``Mcp-Param-*`` suffix (lower case) to argument name, from the tool's schema."""
        schema = self.tools.get(tool) or {}
        properties = schema.get("properties")
        headers: dict[str, str] = {}
        if isinstance(properties, dict):
            for argument, spec in properties.items():
                suffix = spec.get("x-mcp-header") if isinstance(spec, dict) else None
                if isinstance(suffix, str):
                    headers[suffix.lower()] = argument
        return headers


def one_in(draw: Draw, n: int) -> bool:
    """True about once in ``n`` draws."""
    return draw(st.integers(min_value=1, max_value=n)) == 1


def pick(draw: Draw, items: list[Any], otherwise: st.SearchStrategy[Any]) -> Any:
    """One of ``items`` (what the server revealed so far), or ``otherwise`` when there are none.

    The pool grows between examples, so the same choices must mean the same draws whatever it
    holds (Hypothesis replays choices when it shrinks): both are always drawn, and the pool
    only decides which one is used.
    """
    index = draw(st.integers(min_value=0, max_value=1023))
    fallback = draw(otherwise)
    return items[index % len(items)] if items else fallback


# -- values from a schema -------------------------------------------------------------------


def value_for(draw: Draw, schema: Any, *, tool: str, name: str, task: bool) -> Any:
    """A value of the type ``schema`` names (or anything, for schemas it cannot read)."""
    hint = ARGUMENT_HINTS.get((tool, name))
    if hint is not None:
        return draw(hint(task))
    if not isinstance(schema, dict):
        return draw(json_values)
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return draw(st.sampled_from(schema["enum"]))
    kind = schema.get("type")
    if isinstance(kind, list) and kind:
        kind = draw(st.sampled_from(kind))
    if kind == "string":
        return draw(_TEXT)
    if kind == "integer":
        return draw(st.integers(min_value=-5, max_value=100) | st.integers())
    if kind == "number":
        return draw(st.integers(min_value=-5, max_value=5) | st.floats(-1e6, 1e6))
    if kind == "boolean":
        return draw(st.booleans())
    if kind == "null":
        return None
    if kind == "array":
        items = schema.get("items")
        count = draw(st.integers(min_value=0, max_value=3))
        return [value_for(draw, items, tool=tool, name=name, task=task) for _ in range(count)]
    if kind == "object":
        return draw(json_objects)
    return draw(json_values)


def _seconds(task: bool) -> st.SearchStrategy[Any]:
    """``slow_compute``: short enough to answer in a direct call, long ones only as tasks."""
    short = st.floats(min_value=-1.0, max_value=0.2) | st.integers(min_value=-3, max_value=0)
    if not task:
        return short
    return short | st.sampled_from([3600, 1e300, 2**70])


ARGUMENT_HINTS: Final[dict[tuple[str, str], Any]] = {("slow_compute", "seconds"): _seconds}
"""Per-argument value strategies where any value of the type would stall the fuzzer (a direct
call of ``slow_compute`` sleeps for ``seconds``); they take whether the call may be a task."""


def arguments_for(draw: Draw, tool: str, schema: Mapping[str, Any], *, task: bool) -> Any:
    """Arguments for ``tool``: mostly schema-shaped, then bent."""
    if one_in(draw, 25):
        return draw(json_values)  # not even an object, or any object
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    required = (
        [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    )
    arguments: dict[str, Any] = {}
    for name, spec in properties.items():
        if name in required or draw(st.booleans()):
            arguments[name] = value_for(draw, spec, tool=tool, name=name, task=task)
    if arguments and one_in(draw, 6):
        del arguments[draw(st.sampled_from(sorted(arguments)))]
    if properties and one_in(draw, 6):
        arguments[draw(st.sampled_from(sorted(properties)))] = draw(json_values)
    if one_in(draw, 5):  # a name the tool never declared (issue 18: greet {"seconds": null})
        arguments[draw(_NAMES | st.sampled_from(["ctx", "seconds", "kwargs"]))] = draw(json_values)
    if one_in(draw, 40):
        arguments[draw(_NAMES)] = draw(out_of_range)
    if not task:
        # A bent value of a hinted argument (``seconds`` replaced by any JSON value, 497
        # say) would stall a direct call as surely as a drawn one: it is drawn again from
        # its hint. (Its other bent values, of other types, are refused by the tool's schema.)
        for name, value in arguments.items():
            hint = ARGUMENT_HINTS.get((tool, name))
            if hint is not None and _number(value) and value > 1:
                arguments[name] = draw(hint(False))
    return arguments


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# -- input responses ------------------------------------------------------------------------


def answer(draw: Draw) -> Any:
    """An answer to an input request: elicitation, sampling or roots shaped, or junk."""
    kind = draw(st.sampled_from(["elicit", "elicit", "sample", "roots", "junk-object", "junk"]))
    if kind == "elicit":
        reply: dict[str, Any] = {
            "action": draw(st.sampled_from(["accept", "accept", "decline", "cancel"]) | _TEXT)
        }
        if draw(st.booleans()):
            reply["content"] = draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "name": _TEXT | json_scalars,
                        "confirm": st.booleans() | json_scalars,
                        "ok": st.booleans(),
                        "context": _TEXT,
                        "color": _TEXT,
                    },
                )
                | json_values
            )
        return reply
    if kind == "sample":
        text = draw(_TEXT | json_scalars)
        return {"role": "assistant", "content": {"type": "text", "text": text}, "model": "fuzz"}
    if kind == "roots":
        uris = draw(st.lists(_TEXT.map(lambda t: f"file:///{t}") | json_scalars, max_size=2))
        return {"roots": [{"uri": uri} for uri in uris]}
    if kind == "junk-object":
        return draw(json_objects)
    return draw(json_values)


def input_responses(draw: Draw, pool: Pool, *, objects_only: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        reply = answer(draw)
        if objects_only and not isinstance(reply, dict) and not one_in(draw, 10):
            reply = {"action": "accept"}
        known = pick(draw, pool.input_keys, _NAMES)
        responses[known if not one_in(draw, 4) else draw(_NAMES)] = reply
    return responses


# -- requests -------------------------------------------------------------------------------

CORE_METHODS: Final = (
    "tools/call",
    "tools/call",
    "tools/call",
    "tools/call",
    "tasks/get",
    "tasks/update",
    "tasks/update",
    "tasks/cancel",
    "resources/read",
    "prompts/get",
    "completion/complete",
    "subscriptions/listen",
    "server/discover",
    "tools/list",
    "prompts/list",
    "resources/list",
    "resources/templates/list",
)


def capabilities(draw: Draw, *, tasks: bool | None = None) -> dict[str, Any]:
    caps: dict[str, Any] = {}
    for name in ("elicitation", "sampling", "roots"):
        if not one_in(draw, 3):
            caps[name] = {}
    declared = draw(st.booleans()) if tasks is None else tasks
    if declared:
        caps["extensions"] = {TASKS_EXTENSION: {}}
    return caps


def meta_extras(draw: Draw) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if one_in(draw, 4):
        extras["progressToken"] = draw(st.integers(0, 10**6) | _NAMES)
    if one_in(draw, 4):
        extras["io.modelcontextprotocol/logLevel"] = draw(
            st.sampled_from(["debug", "info", "warning", "error"])
        )
    return extras


@attrs.frozen
class Step:
    """One request to send: method, params, the capabilities it declares, extra ``_meta``."""

    method: str
    params: dict[str, Any]
    capabilities: dict[str, Any]
    meta: dict[str, Any]
    answers: tuple[dict[str, Any], ...] = ()
    """The legacy era's answers (``{"result": ...}`` or ``{"error": ...}``) to the requests the
    server sends while this one runs (``elicitation/create``...), in order; drawn in advance,
    since they are needed on the trio side, mid-request."""


def step(draw: Draw, catalogue: Catalogue, pool: Pool) -> Step:
    method = draw(st.sampled_from(CORE_METHODS))
    caps = capabilities(draw)
    task = TASKS_EXTENSION in caps.get("extensions", {})
    params: dict[str, Any]
    if method == "tools/call":
        params = tool_call(draw, catalogue, pool, task=task)
    elif method in ("tasks/get", "tasks/update", "tasks/cancel"):
        caps = capabilities(draw, tasks=not one_in(draw, 15))
        params = {"taskId": task_id(draw, pool)}
        if method == "tasks/update":
            params["inputResponses"] = (
                input_responses(draw, pool, objects_only=True)
                if not one_in(draw, 10)
                else draw(json_values)
            )
    elif method == "resources/read":
        params = {"uri": resource_uri(draw, catalogue)}
    elif method == "prompts/get":
        params = prompt_get(draw, catalogue)
    elif method == "completion/complete":
        params = completion(draw, catalogue)
    elif method == "subscriptions/listen":
        params = {"notifications": listen_filter(draw, catalogue, pool)}
    else:
        params = {} if not one_in(draw, 10) else {"cursor": draw(json_values)}
    return Step(method, params, caps, meta_extras(draw))


def task_id(draw: Draw, pool: Pool) -> Any:
    known = pick(draw, pool.task_ids, _NAMES)
    return known if not one_in(draw, 6) else draw(_NAMES | _TEXT | st.just(""))


def tool_call(draw: Draw, catalogue: Catalogue, pool: Pool, *, task: bool) -> dict[str, Any]:
    names = sorted(catalogue.tools) or ["none"]
    preferred = pick(draw, pool.task_tools, st.sampled_from(names))
    name = preferred if draw(st.booleans()) else draw(st.sampled_from(names))
    if one_in(draw, 20):
        name = draw(_NAMES)
    schema = catalogue.tools.get(name) or {"type": "object"}
    params: dict[str, Any] = {"name": name}
    if not one_in(draw, 20):
        params["arguments"] = arguments_for(draw, name, schema, task=task)
    if one_in(draw, 4):
        params["inputResponses"] = input_responses(draw, pool, objects_only=False)
    if one_in(draw, 6):
        states = [state for tool, state in pool.states if tool == name]
        sealed = pick(draw, states, _TEXT)
        params["requestState"] = sealed if draw(st.booleans()) else draw(_TEXT)
    return params


def resource_uri(draw: Draw, catalogue: Catalogue) -> Any:
    choice = draw(st.integers(0, 5))
    if choice <= 1 and catalogue.resources:
        return draw(st.sampled_from(catalogue.resources))
    if choice <= 3 and catalogue.templates:
        template = draw(st.sampled_from(catalogue.templates))
        filled = template
        while "{" in filled and "}" in filled.split("{", 1)[1]:
            head, rest = filled.split("{", 1)
            filled = (
                head + draw(_TEXT.filter(lambda t: "/" not in t) | _NAMES) + rest.split("}", 1)[1]
            )
        return filled
    return draw(_TEXT | json_scalars)


def prompt_get(draw: Draw, catalogue: Catalogue) -> dict[str, Any]:
    names = sorted(catalogue.prompts)
    name = draw(st.sampled_from(names)) if names and not one_in(draw, 10) else draw(_NAMES)
    params: dict[str, Any] = {"name": name}
    if draw(st.booleans()):
        declared = catalogue.prompts.get(name, ())
        arguments: Any = {arg: draw(_TEXT) for arg in declared if not one_in(draw, 5)}
        if one_in(draw, 5):
            arguments[draw(_NAMES)] = draw(_TEXT)
        if one_in(draw, 8):
            arguments = draw(json_values)
        params["arguments"] = arguments
    return params


def completion(draw: Draw, catalogue: Catalogue) -> dict[str, Any]:
    kind = draw(st.sampled_from(["prompt", "resource", "junk"]))
    if catalogue.prompts and kind == "prompt":
        name = draw(st.sampled_from(sorted(catalogue.prompts)))
        ref: Any = {"type": "ref/prompt", "name": name}
        arguments = catalogue.prompts[name] or ("x",)
        argument: Any = {"name": draw(st.sampled_from(arguments) | _NAMES), "value": draw(_TEXT)}
    elif catalogue.templates and kind == "resource":
        ref = {"type": "ref/resource", "uri": draw(st.sampled_from(catalogue.templates))}
        argument = {"name": draw(_NAMES), "value": draw(_TEXT)}
    else:
        ref, argument = draw(json_values), draw(json_values)
    params: dict[str, Any] = {"ref": ref, "argument": argument}
    if one_in(draw, 3):
        params["context"] = draw(
            st.fixed_dictionaries({"arguments": st.dictionaries(_NAMES, _TEXT, max_size=2)})
            | json_values
        )
    return params


def listen_filter(draw: Draw, catalogue: Catalogue, pool: Pool) -> Any:
    if one_in(draw, 10):
        return draw(json_values)
    wanted: dict[str, Any] = {}
    for key in ("toolsListChanged", "promptsListChanged", "resourcesListChanged"):
        if draw(st.booleans()):
            wanted[key] = draw(st.booleans()) if not one_in(draw, 10) else draw(json_scalars)
    if draw(st.booleans()):
        uris = st.sampled_from(catalogue.resources) if catalogue.resources else _TEXT
        wanted["resourceSubscriptions"] = draw(st.lists(uris | json_scalars, max_size=3))
    if draw(st.booleans()):
        count = draw(st.integers(min_value=0, max_value=3))
        wanted["taskIds"] = [
            pick(draw, pool.task_ids, _NAMES) if not one_in(draw, 5) else draw(json_scalars)
            for _ in range(count)
        ]
    return wanted


LEGACY_METHODS: Final = (
    "tools/call",
    "tools/call",
    "tools/call",
    "tools/call",
    "ping",
    "logging/setLevel",
    "resources/subscribe",
    "resources/unsubscribe",
    "resources/read",
    "prompts/get",
    "completion/complete",
    "tools/list",
    "prompts/list",
    "resources/list",
    "resources/templates/list",
)
LOG_LEVELS: Final = ("debug", "info", "notice", "warning", "error", "critical", "alert")


def server_request_answer(draw: Draw) -> dict[str, Any]:
    """A client's answer to ``elicitation/create``, ``sampling/createMessage``, ``roots/list``:
    a result shaped for one of them (or junk), or an error."""
    if one_in(draw, 4):
        code = draw(st.sampled_from([-32601, -32602, -32603, -1, 0]) | st.integers(-40000, 40000))
        error: dict[str, Any] = {"code": code, "message": draw(_TEXT)}
        if one_in(draw, 3):
            error["data"] = draw(json_values)
        return {"error": error}
    result = answer(draw)
    return {"result": result if isinstance(result, dict) and not one_in(draw, 10) else {}}


def legacy_step(draw: Draw, catalogue: Catalogue, pool: Pool) -> Step:
    """A request inside an initialize-era session (the session holds the capabilities)."""
    method = draw(st.sampled_from(LEGACY_METHODS))
    params: dict[str, Any]
    if method == "tools/call":
        params = tool_call(draw, catalogue, pool, task=False)
        params.pop("inputResponses", None)  # MRTR: the legacy era asks with requests instead
        params.pop("requestState", None)
    elif method == "logging/setLevel":
        level = draw(st.sampled_from(LOG_LEVELS)) if not one_in(draw, 5) else draw(json_values)
        params = {"level": level}
    elif method in ("resources/subscribe", "resources/unsubscribe", "resources/read"):
        params = {"uri": resource_uri(draw, catalogue)}
    elif method == "prompts/get":
        params = prompt_get(draw, catalogue)
    elif method == "completion/complete":
        params = completion(draw, catalogue)
    else:
        params = {} if not one_in(draw, 10) else {"cursor": draw(json_values)}
    meta: dict[str, Any] = {}
    if one_in(draw, 4):
        meta["progressToken"] = draw(st.integers(0, 10**6) | _NAMES)
    answers = tuple(
        server_request_answer(draw) for _ in range(draw(st.integers(min_value=0, max_value=3)))
    )
    return Step(method, params, {}, meta, answers)


def steps(catalogue: Catalogue, pool: Pool, *, legacy: bool = False) -> st.SearchStrategy[Step]:
    """One request; drawn one at a time, so a step sees what the server answered before it."""

    @st.composite
    def build(draw: Draw) -> Step:
        if legacy:
            return legacy_step(draw, catalogue, pool)
        return step(draw, catalogue, pool)

    return build()
