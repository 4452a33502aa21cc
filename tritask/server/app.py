"""``App``: the registries of tools, prompts, resources and completions, and its extensions.

An ``App`` is a plain description of a server; nothing starts when it is built. Transports
serve it, ``App.running()`` opens what its extensions need (stores, runners) for as long as it
is served.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal, TypeVar, overload

import attrs
import trio
from jsonschema.validators import Draft202012Validator

from tritask._groups import is_lone
from tritask.jsonrpc import JSONValue
from tritask.protocol.auth import check_scope_tokens
from tritask.server.arguments import ArgumentContract
from tritask.server.context import Context
from tritask.server.extension import ConfigurationError, Extension, ServeEnvironment
from tritask.server.hub import Hub
from tritask.server.mrtr import RequestStateSealer
from tritask.server.schema import (
    compile_validator,
    signature_schema,
    type_schema,
    validation_errors,
)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,64}$")


Authorize = Callable[[Context, str, str], Awaitable[None]]
"""``authorize(ctx, kind, name)``: raise a JSON-RPC error to refuse (kind: tool/prompt/resource)."""


def _is_context(parameter: inspect.Parameter, annotation: Any) -> bool:
    if annotation is Context or annotation == "Context":
        return True
    return parameter.name == "ctx" and annotation is inspect.Parameter.empty


def _context_param(fn: Callable[..., Any]) -> str | None:
    import typing

    hints = typing.get_type_hints(fn)
    for parameter in inspect.signature(fn).parameters.values():
        if _is_context(parameter, hints.get(parameter.name, parameter.annotation)):
            return parameter.name
    return None


def _summary(fn: Callable[..., Any]) -> str | None:
    """The first paragraph of a docstring: the default description of a tool/prompt/resource."""
    doc = inspect.getdoc(fn)
    if not doc:
        return None
    return doc.split("\n\n")[0].strip() or None


def _require_async(fn: Callable[..., Any], what: str) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{what} {getattr(fn, '__name__', fn)!r} must be an async function")


@attrs.frozen(kw_only=True)
class ToolDef:
    name: str
    fn: Callable[..., Awaitable[Any]]
    description: str
    input_schema: dict[str, JSONValue]
    title: str | None = None
    output_schema: dict[str, JSONValue] | None = None
    annotations: dict[str, JSONValue] | None = None
    meta: dict[str, JSONValue] | None = None
    context_param: str | None = None
    restartable: bool = True
    required_scopes: frozenset[str] = frozenset()
    """OAuth scopes a ``tools/call`` needs beyond the server-wide ones (HTTP 403 otherwise)."""
    options: Mapping[str, object] = attrs.field(factory=dict)
    """The extensions' keyword options given to ``@app.tool`` (e.g. ``task="required"`` for
    the Tasks extension): each key is read by the extension that claims it in
    ``Extension.tool_options``; one nobody claims stops the app at start."""
    validator: Draft202012Validator = attrs.field(eq=False, repr=False)
    contract: ArgumentContract = attrs.field(eq=False, repr=False)
    """Which arguments ``fn`` can take (``tritask.server.arguments``)."""
    no_argument_errors: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    """``validation_errors(validator, {})``, computed once: a call without arguments is checked
    against the schema exactly as any other (validation is a pure function of the schema and
    the arguments), without running jsonschema again on every call."""

    @no_argument_errors.default
    def _no_argument_errors(self) -> tuple[str, ...]:
        return tuple(validation_errors(self.validator, {}))

    def to_wire(self) -> dict[str, JSONValue]:
        tool: dict[str, JSONValue] = {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.title:
            tool["title"] = self.title
        if self.output_schema is not None:
            tool["outputSchema"] = self.output_schema
        if self.annotations:
            tool["annotations"] = self.annotations
        if self.meta:
            tool["_meta"] = self.meta
        return tool


@attrs.frozen(kw_only=True)
class PromptArgument:
    name: str
    description: str | None = None
    required: bool = False


@attrs.frozen(kw_only=True)
class PromptDef:
    name: str
    fn: Callable[..., Awaitable[Any]]
    description: str | None
    arguments: tuple[PromptArgument, ...]
    title: str | None = None
    context_param: str | None = None

    def to_wire(self) -> dict[str, JSONValue]:
        prompt: dict[str, JSONValue] = {"name": self.name}
        if self.title:
            prompt["title"] = self.title
        if self.description:
            prompt["description"] = self.description
        if self.arguments:
            prompt["arguments"] = [
                {
                    "name": argument.name,
                    **({"description": argument.description} if argument.description else {}),
                    "required": argument.required,
                }
                for argument in self.arguments
            ]
        return prompt


@attrs.frozen(kw_only=True)
class ResourceDef:
    uri: str
    name: str
    fn: Callable[..., Awaitable[Any]]
    description: str | None = None
    mime_type: str | None = None
    title: str | None = None
    context_param: str | None = None

    def to_wire(self) -> dict[str, JSONValue]:
        resource: dict[str, JSONValue] = {"uri": self.uri, "name": self.name}
        if self.title:
            resource["title"] = self.title
        if self.description:
            resource["description"] = self.description
        if self.mime_type:
            resource["mimeType"] = self.mime_type
        return resource


_TEMPLATE_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@attrs.frozen(kw_only=True)
class ResourceTemplateDef:
    uri_template: str
    name: str
    fn: Callable[..., Awaitable[Any]]
    description: str | None = None
    mime_type: str | None = None
    title: str | None = None
    context_param: str | None = None
    pattern: re.Pattern[str] = attrs.field(eq=False, repr=False)

    def match(self, uri: str) -> dict[str, str] | None:
        found = self.pattern.fullmatch(uri)
        return found.groupdict() if found else None

    def to_wire(self) -> dict[str, JSONValue]:
        template: dict[str, JSONValue] = {"uriTemplate": self.uri_template, "name": self.name}
        if self.title:
            template["title"] = self.title
        if self.description:
            template["description"] = self.description
        if self.mime_type:
            template["mimeType"] = self.mime_type
        return template


def _template_pattern(template: str) -> re.Pattern[str]:
    parts: list[str] = []
    position = 0
    for found in _TEMPLATE_VAR.finditer(template):
        parts.append(re.escape(template[position : found.start()]))
        parts.append(f"(?P<{found.group(1)}>[^/]+)")
        position = found.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts))


CompletionFn = Callable[..., Awaitable[Any]]


class App:
    """An MCP server description: registries, extensions, identity and policy."""

    def __init__(
        self,
        name: str,
        version: str,
        *,
        instructions: str | None = None,
        state_key: str | bytes | None = None,
        state_ttl_seconds: float = 900.0,
        authorize: Authorize | None = None,
        cache_ttl_ms: int = 0,
        cache_scope: Literal["public", "private"] = "private",
        extensions: list[Extension] | tuple[Extension, ...] = (),
        auth: Any = None,
    ) -> None:
        self.name = name
        self.auth = auth
        """A ``tritask.auth.BearerAuth``: the HTTP transport requires its bearer tokens (the
        transport's own ``HttpOptions(auth=...)`` wins when both are set)."""
        self.version = version
        self.instructions = instructions
        self.authorize = authorize
        if cache_ttl_ms < 0:
            raise ValueError("cache_ttl_ms must be >= 0")
        self.cache_ttl_ms = cache_ttl_ms
        self.cache_scope = cache_scope
        self._state_key = state_key
        self._state_ttl = state_ttl_seconds
        self._sealer: RequestStateSealer | None = None
        self.tools: dict[str, ToolDef] = {}
        self.prompts: dict[str, PromptDef] = {}
        self.resources: dict[str, ResourceDef] = {}
        self.resource_templates: dict[str, ResourceTemplateDef] = {}
        self.completions: dict[tuple[str, str], CompletionFn] = {}
        self.extensions: dict[str, Extension] = {}
        self.hub = Hub()
        self.capability_overrides: dict[str, JSONValue] = {}
        for extension in extensions:
            self.add_extension(extension)

    # -- identity ------------------------------------------------------------------------

    @property
    def server_info(self) -> dict[str, JSONValue]:
        return {"name": self.name, "version": self.version}

    @property
    def sealer(self) -> RequestStateSealer:
        if self._sealer is None:
            import os

            key = self._state_key or os.environ.get("TRITASK_STATE_KEY") or None
            self._sealer = RequestStateSealer.from_config(key, self._state_ttl)
        return self._sealer

    def capabilities(self) -> dict[str, JSONValue]:
        """What ``server/discover`` advertises (keep :meth:`has_capability` in step)."""
        caps: dict[str, JSONValue] = {}
        if self.tools:
            caps["tools"] = {"listChanged": True}
        if self.prompts:
            caps["prompts"] = {"listChanged": True}
        if self.resources or self.resource_templates:
            caps["resources"] = {"listChanged": True, "subscribe": True}
        if self.completions:
            caps["completions"] = {}
        advertised = {i: ext for i, ext in self.extensions.items() if ext.advertised}
        if advertised:
            caps["extensions"] = {ext_id: ext.settings() for ext_id, ext in advertised.items()}
        caps.update(self.capability_overrides)
        return caps

    def has_capability(self, name: str) -> bool:
        """``name in self.capabilities()``, without building them (routing asks per request).

        Read from the registries each time, so it cannot go stale, and no extension's
        ``settings()`` is called.
        """
        if name in self.capability_overrides:
            return True
        if name == "tools":
            return bool(self.tools)
        if name == "prompts":
            return bool(self.prompts)
        if name == "resources":
            return bool(self.resources or self.resource_templates)
        if name == "completions":
            return bool(self.completions)
        if name == "extensions":
            return any(ext.advertised for ext in self.extensions.values())
        return False

    # -- extensions ----------------------------------------------------------------------

    def add_extension(self, extension: Extension, *, first: bool = False) -> None:
        """Register ``extension``; ``first=True`` puts it before those already registered.

        Extensions wrap tool calls (``around_tool_call``) and open their lifespans in
        registration order, so the first one encloses all the others (a tracing extension
        added by ``tritask serve --otel`` after the app was built goes first).
        """
        if not extension.id or "/" not in extension.id:
            raise ValueError("an extension id must be a prefixed name like 'vendor.example/name'")
        if extension.id in self.extensions:
            raise ValueError(f"extension {extension.id!r} is already registered")
        if first:
            later = dict(self.extensions)
            self.extensions.clear()
            self.extensions[extension.id] = extension
            self.extensions.update(later)
        else:
            self.extensions[extension.id] = extension
        extension.attached(self)

    def check(self) -> None:
        """Refuse a configuration that cannot be served (``ConfigurationError``, one line).

        A tool option no extension reads (``@app.tool(tsk=...)``), then each extension's own
        ``check`` (the Tasks extension: policies naming unknown tools, a policy given twice).
        ``running()`` calls it before opening anything.
        """
        claimed: set[str] = set()
        for extension in self.extensions.values():
            claimed |= extension.tool_options
        for tool in self.tools.values():
            unknown = sorted(set(tool.options) - claimed)
            if unknown:
                raise ConfigurationError.unknown(
                    f"tool {tool.name!r}: the @app.tool keyword",
                    unknown[0],
                    claimed | _tool_keywords(),
                )
        for extension in self.extensions.values():
            extension.check(self)

    @asynccontextmanager
    async def running(self, env: ServeEnvironment | None = None) -> AsyncIterator[App]:
        """Open every extension's resources for as long as the app is served.

        The configuration is checked first (``check()``): a ``ConfigurationError`` leaves
        nothing opened.
        """
        env = env or ServeEnvironment()
        self.check()
        raised: BaseException | None = None
        unwrapped: BaseException | None = None
        try:
            async with AsyncExitStack() as stack:
                for extension in self.extensions.values():
                    await stack.enter_async_context(extension.lifespan(self, env))
                try:
                    yield self
                except BaseException as error:
                    raised = error
                    raise
                finally:
                    self.hub.close()
                    with trio.CancelScope(shield=True):
                        await trio.lowlevel.checkpoint()
        except BaseExceptionGroup as group:
            # An extension's nursery wrapped the caller's own exception: hand it back alone.
            if not is_lone(group, raised):
                raise
            unwrapped = raised
        if unwrapped is not None:
            raise unwrapped

    # -- tools ---------------------------------------------------------------------------

    @overload
    def tool(self, name: F, /) -> F: ...

    @overload
    def tool(
        self,
        name: str | None = None,
        *,
        description: str | None = None,
        title: str | None = None,
        input_schema: dict[str, JSONValue] | None = None,
        output_schema: dict[str, JSONValue] | None = None,
        annotations: dict[str, JSONValue] | None = None,
        meta: dict[str, JSONValue] | None = None,
        restartable: bool = True,
        required_scopes: Collection[str] = (),
        **options: Any,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        name: str | F | None = None,
        *,
        description: str | None = None,
        title: str | None = None,
        input_schema: dict[str, JSONValue] | None = None,
        output_schema: dict[str, JSONValue] | None = None,
        annotations: dict[str, JSONValue] | None = None,
        meta: dict[str, JSONValue] | None = None,
        restartable: bool = True,
        required_scopes: Collection[str] = (),
        **options: Any,
    ) -> F | Callable[[F], F]:
        """Register an async function as a tool; its schema is derived unless given.

        Works bare (``@app.tool``) and called (``@app.tool()``, ``@app.tool("name", ...)``):
        a bare decorator that silently registered nothing would be a trap. Other keywords are
        options for the app's extensions (``task=...`` for the Tasks extension), kept in
        ``ToolDef.options``; one no extension reads stops the app at start.
        """

        def register(fn: F) -> F:
            self.add_tool(
                fn,
                name=None if callable(name) else name,
                description=description,
                title=title,
                input_schema=input_schema,
                output_schema=output_schema,
                annotations=annotations,
                meta=meta,
                restartable=restartable,
                required_scopes=required_scopes,
                **options,
            )
            return fn

        if callable(name):
            return register(name)
        return register

    def add_tool(
        self,
        fn: Callable[..., Awaitable[Any]],
        *,
        name: str | None = None,
        description: str | None = None,
        title: str | None = None,
        input_schema: dict[str, JSONValue] | None = None,
        output_schema: dict[str, JSONValue] | None = None,
        annotations: dict[str, JSONValue] | None = None,
        meta: dict[str, JSONValue] | None = None,
        restartable: bool = True,
        required_scopes: Collection[str] = (),
        **options: Any,
    ) -> ToolDef:
        """Register ``fn`` as a tool; the schema it advertises and the arguments it takes agree.

        Without ``input_schema`` the schema is derived from the signature, with
        ``additionalProperties: false`` unless ``fn`` takes ``**kwargs``, and a call naming an
        argument ``fn`` cannot take is refused with ``-32602`` before anything runs. With an
        explicit ``input_schema`` that schema decides (its errors are ``isError`` results);
        extras it allows are passed to a ``**kwargs`` function and dropped for any other, and
        it may not declare a property ``fn`` cannot take (``ValueError``). Details:
        ``tritask.server.arguments``.

        ``required_scopes`` are OAuth scopes a call needs beyond ``BearerAuth``'s required
        ones, checked before anything runs (HTTP 403 ``insufficient_scope`` naming all of
        them); ``tools/list`` still lists the tool, so a client can step up. Only requests
        with a verified token are checked (see ``docs/security.md``).
        """
        _require_async(fn, "tool")
        tool_name = name or fn.__name__
        if not _TOOL_NAME.match(tool_name):
            raise ValueError(f"tool name {tool_name!r} must match {_TOOL_NAME.pattern}")
        text = description or _summary(fn)
        if not text:
            raise ValueError(f"tool {tool_name!r} needs a description (argument or docstring)")
        context_param = _context_param(fn)
        explicit = input_schema
        if input_schema is None:
            input_schema, _ = signature_schema(fn, _is_context)
        validator = compile_validator(input_schema)
        contract = ArgumentContract.of(
            tool_name, fn, context_param=context_param, input_schema=explicit
        )
        tool = ToolDef(
            name=tool_name,
            fn=fn,
            description=text,
            title=title,
            input_schema=input_schema,
            output_schema=output_schema,
            annotations=annotations,
            meta=meta,
            context_param=context_param,
            restartable=restartable,
            required_scopes=check_scope_tokens(required_scopes, f"tool {tool_name!r}"),
            options=dict(options),
            validator=validator,
            contract=contract,
        )
        self.tools[tool_name] = tool
        self.notify_tools_changed()
        return tool

    def remove_tool(self, name: str) -> None:
        if self.tools.pop(name, None) is not None:
            self.notify_tools_changed()

    # -- prompts -------------------------------------------------------------------------

    @overload
    def prompt(self, name: F, /) -> F: ...

    @overload
    def prompt(
        self,
        name: str | None = None,
        *,
        description: str | None = None,
        title: str | None = None,
    ) -> Callable[[F], F]: ...

    def prompt(
        self,
        name: str | F | None = None,
        *,
        description: str | None = None,
        title: str | None = None,
    ) -> F | Callable[[F], F]:
        """Register an async function as a prompt; bare (``@app.prompt``) or called."""

        def register(fn: F) -> F:
            self.add_prompt(
                fn, name=None if callable(name) else name, description=description, title=title
            )
            return fn

        if callable(name):
            return register(name)
        return register

    def add_prompt(
        self,
        fn: Callable[..., Awaitable[Any]],
        *,
        name: str | None = None,
        description: str | None = None,
        title: str | None = None,
    ) -> PromptDef:
        _require_async(fn, "prompt")
        schema, _ = signature_schema(fn, _is_context)
        properties = schema.get("properties", {})
        required_names = schema.get("required", [])
        required = set(required_names) if isinstance(required_names, list) else set()
        assert isinstance(properties, dict)
        arguments = tuple(
            PromptArgument(
                name=arg,
                description=spec.get("description") if isinstance(spec, dict) else None,
                required=arg in required,
            )
            for arg, spec in properties.items()
        )
        prompt = PromptDef(
            name=name or fn.__name__,
            fn=fn,
            description=description or _summary(fn),
            arguments=arguments,
            title=title,
            context_param=_context_param(fn),
        )
        self.prompts[prompt.name] = prompt
        self.notify_prompts_changed()
        return prompt

    def remove_prompt(self, name: str) -> None:
        if self.prompts.pop(name, None) is not None:
            self.notify_prompts_changed()

    # -- resources -----------------------------------------------------------------------

    def resource(
        self,
        uri: str,
        *,
        name: str | None = None,
        description: str | None = None,
        mime_type: str | None = None,
        title: str | None = None,
    ) -> Callable[[F], F]:
        """Register a fixed resource, or a template when ``uri`` contains ``{variables}``."""

        def register(fn: F) -> F:
            _require_async(fn, "resource")
            text = description or _summary(fn)
            context_param = _context_param(fn)
            if _TEMPLATE_VAR.search(uri):
                self.resource_templates[uri] = ResourceTemplateDef(
                    uri_template=uri,
                    name=name or fn.__name__,
                    fn=fn,
                    description=text,
                    mime_type=mime_type,
                    title=title,
                    context_param=context_param,
                    pattern=_template_pattern(uri),
                )
            else:
                self.resources[uri] = ResourceDef(
                    uri=uri,
                    name=name or fn.__name__,
                    fn=fn,
                    description=text,
                    mime_type=mime_type,
                    title=title,
                    context_param=context_param,
                )
            self.notify_resources_changed()
            return fn

        return register

    def completion(self, ref_type: str, name: str) -> Callable[[F], F]:
        """Register completions for ``ref/prompt`` name or ``ref/resource`` URI template.

        The function receives ``(argument_name, value, context_arguments)`` and returns a list
        of strings or a ``{"values", "total", "hasMore"}`` mapping.
        """
        if ref_type not in ("ref/prompt", "ref/resource"):
            raise ValueError("ref_type must be 'ref/prompt' or 'ref/resource'")

        def register(fn: F) -> F:
            _require_async(fn, "completion")
            self.completions[(ref_type, name)] = fn
            return fn

        return register

    # -- change notifications ------------------------------------------------------------

    def notify_tools_changed(self) -> None:
        self.hub.publish("notifications/tools/list_changed", {}, {"toolsListChanged": True})

    def notify_prompts_changed(self) -> None:
        self.hub.publish("notifications/prompts/list_changed", {}, {"promptsListChanged": True})

    def notify_resources_changed(self) -> None:
        self.hub.publish("notifications/resources/list_changed", {}, {"resourcesListChanged": True})

    def notify_resource_updated(self, uri: str) -> None:
        self.hub.publish(
            "notifications/resources/updated", {"uri": uri}, {"resourceSubscriptions": [uri]}
        )

    # -- lookups ---------------------------------------------------------------------------

    def find_template(self, uri: str) -> tuple[ResourceTemplateDef, dict[str, str]] | None:
        for template in self.resource_templates.values():
            variables = template.match(uri)
            if variables is not None:
                return template, variables
        return None


def _tool_keywords() -> set[str]:
    """``App.add_tool``'s own keywords, read from its signature (so never stale): suggested
    when an extension option is misspelt."""
    parameters = inspect.signature(App.add_tool).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def json_schema_for(annotation: Any) -> dict[str, JSONValue]:
    """Public helper: the JSON Schema tritask derives for a Python annotation."""
    return type_schema(annotation)
