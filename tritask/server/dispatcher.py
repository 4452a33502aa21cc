"""The dispatcher: one request in, one response out, in the exact validation order.

Order (the conformance suite depends on it): version header present, ``_meta`` fields, header
version equals body version, version supported, routing headers, method known, capability
declared, then the method's own parameters. Transports without headers skip the header steps.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from tritask.jsonrpc import (
    InternalError,
    InvalidParams,
    JsonRpcError,
    JSONValue,
    MethodNotFound,
    Request,
    error_message,
    result_message,
)
from tritask.protocol import headers as hdr
from tritask.protocol.auth import AccessToken, InsufficientScope
from tritask.protocol.capabilities import declared_extensions
from tritask.protocol.errors import (
    MissingRequiredClientCapability,
    ResourceNotFound,
    UnsupportedProtocolVersion,
)
from tritask.protocol.meta import (
    SUBSCRIPTION_ID_KEY,
    parse_optional_meta,
    parse_request_meta,
)
from tritask.protocol.versions import INPUT_REQUIRED_METHODS, SUPPORTED_VERSIONS
from tritask.server import invocation
from tritask.server.app import App, ToolDef
from tritask.server.context import Context, Emit, HandOff
from tritask.server.listen import ListenStream
from tritask.server.mrtr import InputRequired
from tritask.server.results import (
    InvalidResult,
    prompt_result,
    resource_contents,
)

log = logging.getLogger("tritask.server")

Handler = Callable[[dict[str, JSONValue], Context], Awaitable[dict[str, JSONValue]]]

_LIST_FLAGS = {
    "toolsListChanged": "tools",
    "promptsListChanged": "prompts",
    "resourcesListChanged": "resources",
}


class Dispatcher:
    """Routes requests for one ``App``; stateless between requests."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._core: dict[str, tuple[str | None, Handler]] = {
            "server/discover": (None, self._discover),
            "tools/list": ("tools", self._tools_list),
            "tools/call": ("tools", self._tools_call),
            "prompts/list": ("prompts", self._prompts_list),
            "prompts/get": ("prompts", self._prompts_get),
            "resources/list": ("resources", self._resources_list),
            "resources/templates/list": ("resources", self._templates_list),
            "resources/read": ("resources", self._resources_read),
            "completion/complete": ("completions", self._complete),
            "subscriptions/listen": (None, self._listen),
        }
        self._declared_params: dict[str, tuple[ToolDef, dict[str, tuple[str, str | None]]]] = {}

    # -- entry point ---------------------------------------------------------------------

    async def handle_request(
        self,
        request: Request,
        *,
        headers: hdr.HeaderView | None = None,
        principal: Any = None,
        transport: str = "direct",
        emit: Emit | None = None,
        cancel_scope: trio.CancelScope | None = None,
        auth: AccessToken | None = None,
        hand_off: HandOff | None = None,
    ) -> dict[str, JSONValue]:
        """The response message for ``request`` (a result or an error, never an exception).

        ``auth`` is the request's verified token (``ctx.auth``). A transport that passes one
        answers :class:`InsufficientScope` itself (HTTP 403), so that error propagates.
        ``hand_off`` is the transport's offer to deliver a long-lived stream itself
        (:meth:`Context.hand_off`): when it takes one, the response returned here is to be
        sent after that stream has ended.
        """
        try:
            result = await self._handle(
                request, headers, principal, transport, emit, cancel_scope, auth, hand_off
            )
        except InsufficientScope as error:
            if auth is not None:
                raise
            return error_message(request.id, error)
        except JsonRpcError as error:
            if error.code == -32603:
                log.warning("%s (id %r) failed: %s", request.method, request.id, error.message)
            return error_message(request.id, error)
        except Exception:
            log.exception("handler for %s (id %r) raised", request.method, request.id)
            return error_message(request.id, InternalError("Internal error"))
        return result_message(request.id, result)

    async def _handle(
        self,
        request: Request,
        headers: hdr.HeaderView | None,
        principal: Any,
        transport: str,
        emit: Emit | None,
        cancel_scope: trio.CancelScope | None,
        auth: AccessToken | None = None,
        hand_off: HandOff | None = None,
    ) -> dict[str, JSONValue]:
        params: dict[str, JSONValue] = dict(request.params or {})
        method = request.method
        header_version = None
        if headers is not None:
            header_version = hdr.check_protocol_version_present(headers)
        meta = parse_request_meta(params)
        if headers is not None and header_version != meta.protocol_version:
            # The header was decoded once above; this only raises the mismatch error.
            hdr.check_protocol_version_matches(headers, meta.protocol_version)
        if meta.protocol_version not in SUPPORTED_VERSIONS:
            raise UnsupportedProtocolVersion(meta.protocol_version, list(SUPPORTED_VERSIONS))
        meta = parse_optional_meta(meta)
        handler, extension_id = self._route(method)
        if headers is not None:
            self._check_routing_headers(headers, method, params)
        if handler is None:
            raise MethodNotFound(f"Method not found: {method}")
        negotiated = self._negotiate(meta.client_capabilities)
        if extension_id is not None and extension_id not in negotiated:
            extension = self.app.extensions[extension_id]
            if extension.requires_negotiation(method):
                raise MissingRequiredClientCapability({"extensions": {extension_id: {}}})
        input_responses, request_state = self._mrtr_inputs(method, params, principal)
        ctx = Context(
            app=self.app,
            method=method,
            meta=meta,
            principal=principal,
            transport=transport,
            request_id=request.id,
            params=params,
            extensions=negotiated,
            emit=emit,
            cancel_scope=cancel_scope,
            input_responses=input_responses,
            request_state=request_state,
            auth=auth,
            hand_off=hand_off,
        )
        result = await handler(params, ctx)
        return self.shape(result)

    def shape(self, result: dict[str, JSONValue]) -> dict[str, JSONValue]:
        """Every result carries ``resultType`` and names the server in ``_meta``."""
        return invocation.shape(self.app, result)

    # -- routing and negotiation ---------------------------------------------------------

    def core_handler(self, method: str) -> Handler | None:
        """The handler of a core method the app serves (its capability present), if any."""
        core = self._core.get(method)
        if core is None:
            return None
        capability, handler = core
        if capability is None or self.app.has_capability(capability):
            return handler
        return None

    def _route(self, method: str) -> tuple[Handler | None, str | None]:
        if method in self._core:
            return self.core_handler(method), None
        for extension_id, extension in self.app.extensions.items():
            extension_handler = extension.methods().get(method)
            if extension_handler is not None:
                return extension_handler, extension_id
        return None, None

    def _check_routing_headers(
        self, headers: hdr.HeaderView, method: str, params: Mapping[str, JSONValue]
    ) -> None:
        hdr.check_method(headers, method)
        source = hdr.CORE_NAME_SOURCES.get(method)
        required = True
        if source is None:
            for extension in self.app.extensions.values():
                source = extension.name_source(method)
                if source is not None:
                    required = not extension.name_header_optional(method)
                    break
        hdr.check_name(headers, params, source, required=required)
        if method == "tools/call":
            name = params.get("name")
            tool = self.app.tools.get(name) if isinstance(name, str) else None
            arguments = params.get("arguments")
            if tool is not None and isinstance(arguments, dict | None):
                declared = self._param_headers(tool)
                if declared:
                    hdr.check_params(headers, arguments or {}, declared)

    def _param_headers(self, tool: ToolDef) -> dict[str, tuple[str, str | None]]:
        """``hdr.param_headers`` of a registered tool, derived once per registration."""
        cached = self._declared_params.get(tool.name)
        if cached is None or cached[0] is not tool:
            cached = (tool, hdr.param_headers(tool.input_schema))
            self._declared_params[tool.name] = cached
        return cached[1]

    def _negotiate(self, capabilities: dict[str, JSONValue]) -> dict[str, JSONValue]:
        negotiated: dict[str, JSONValue] = {}
        for extension_id, settings in declared_extensions(capabilities).items():
            extension = self.app.extensions.get(extension_id)
            if extension is None:
                continue
            assert isinstance(settings, dict)
            extension.negotiate(settings)
            negotiated[extension_id] = settings
        return negotiated

    def _mrtr_inputs(
        self, method: str, params: Mapping[str, JSONValue], principal: Any
    ) -> tuple[dict[str, JSONValue] | None, JSONValue]:
        if method not in INPUT_REQUIRED_METHODS:
            return None, None
        responses = params.get("inputResponses")
        if responses is not None and (
            not isinstance(responses, dict)
            or not all(isinstance(key, str) and key for key in responses)
        ):
            raise InvalidParams("inputResponses must be an object keyed by input request key")
        state: JSONValue = None
        raw_state = params.get("requestState")
        if raw_state is not None:
            state = self.app.sealer.open(
                raw_state,
                method=method,
                name=invocation.name_param(method, params),
                principal=principal,
            )
        return responses, state

    # -- core methods --------------------------------------------------------------------

    def _cacheable(self, result: dict[str, JSONValue]) -> dict[str, JSONValue]:
        result["ttlMs"] = self.app.cache_ttl_ms
        result["cacheScope"] = self.app.cache_scope
        return result

    @staticmethod
    def _check_cursor(params: Mapping[str, JSONValue]) -> None:
        cursor = params.get("cursor")
        if cursor is not None:
            raise InvalidParams("Invalid cursor: this server returns complete lists")

    async def _discover(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        result: dict[str, JSONValue] = {
            "supportedVersions": list(SUPPORTED_VERSIONS),
            "capabilities": self.app.capabilities(),
        }
        if self.app.instructions:
            result["instructions"] = self.app.instructions
        return self._cacheable(result)

    async def _tools_list(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        self._check_cursor(params)
        tools = [tool.to_wire() for tool in self.app.tools.values()]
        return self._cacheable({"tools": tools})

    async def _tools_call(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        return await invocation.call_tool(params, ctx)

    async def _prompts_list(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        self._check_cursor(params)
        prompts = [prompt.to_wire() for prompt in self.app.prompts.values()]
        return self._cacheable({"prompts": prompts})

    async def _prompts_get(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParams("prompts/get requires a non-empty string params.name")
        prompt = self.app.prompts.get(name)
        if prompt is None:
            raise InvalidParams(f"Unknown prompt: {name}", {"name": name})
        if self.app.authorize is not None:
            await self.app.authorize(ctx, "prompt", name)
        arguments = params.get("arguments") or {}
        if not isinstance(arguments, dict) or not all(
            isinstance(value, str) for value in arguments.values()
        ):
            raise InvalidParams("prompts/get params.arguments must map names to strings")
        known = {argument.name for argument in prompt.arguments}
        unknown = sorted(set(arguments) - known)
        if unknown:
            raise InvalidParams(f"Unknown prompt arguments: {', '.join(unknown)}")
        missing = [a.name for a in prompt.arguments if a.required and a.name not in arguments]
        if missing:
            raise InvalidParams(f"Missing required prompt arguments: {', '.join(missing)}")
        value = await invocation.invoke(prompt.fn, prompt.context_param, ctx, arguments)
        if isinstance(value, InputRequired):
            return invocation.input_required_result(value, ctx)
        try:
            return prompt_result(value, prompt.description)
        except InvalidResult as error:
            log.error("prompt %s returned an invalid result: %s", name, error)
            raise InternalError("Prompt returned an invalid result") from error

    async def _resources_list(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        self._check_cursor(params)
        resources = [resource.to_wire() for resource in self.app.resources.values()]
        return self._cacheable({"resources": resources})

    async def _templates_list(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        self._check_cursor(params)
        templates = [template.to_wire() for template in self.app.resource_templates.values()]
        return self._cacheable({"resourceTemplates": templates})

    async def _resources_read(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        uri = params.get("uri")
        if not isinstance(uri, str) or not uri:
            raise InvalidParams("resources/read requires a non-empty string params.uri")
        resource = self.app.resources.get(uri)
        if resource is not None:
            fn, context_param, mime_type = resource.fn, resource.context_param, resource.mime_type
            arguments: dict[str, str] = {}
        else:
            found = self.app.find_template(uri)
            if found is None:
                raise ResourceNotFound(uri)
            template, arguments = found
            fn, context_param, mime_type = template.fn, template.context_param, template.mime_type
        if self.app.authorize is not None:
            await self.app.authorize(ctx, "resource", uri)
        value = await invocation.invoke(fn, context_param, ctx, arguments)
        if isinstance(value, InputRequired):
            return invocation.input_required_result(value, ctx)
        if value is None:
            raise ResourceNotFound(uri)
        try:
            contents = resource_contents(value, uri, mime_type)
        except InvalidResult as error:
            log.error("resource %s returned an invalid result: %s", uri, error)
            raise InternalError("Resource returned an invalid result") from error
        return self._cacheable({"contents": contents})

    async def _complete(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        ref = params.get("ref")
        argument = params.get("argument")
        if not isinstance(ref, dict) or not isinstance(argument, dict):
            raise InvalidParams("completion/complete requires params.ref and params.argument")
        ref_type = ref.get("type")
        key = ref.get("name") if ref_type == "ref/prompt" else ref.get("uri")
        arg_name, arg_value = argument.get("name"), argument.get("value")
        if not isinstance(ref_type, str) or not isinstance(key, str):
            raise InvalidParams("completion/complete params.ref is invalid")
        if not isinstance(arg_name, str) or not isinstance(arg_value, str):
            raise InvalidParams("completion/complete params.argument needs name and value")
        context = params.get("context")
        context_args = context.get("arguments") if isinstance(context, dict) else None
        fn = self.app.completions.get((ref_type, key))
        values: list[str] = []
        total: int | None = None
        has_more = False
        if fn is not None:
            produced = await fn(arg_name, arg_value, context_args or {})
            if isinstance(produced, dict):
                values = list(produced.get("values", []))
                total = produced.get("total")
                has_more = bool(produced.get("hasMore", False))
            else:
                values = list(produced)
        elif ref_type == "ref/prompt" and key not in self.app.prompts:
            raise InvalidParams(f"Unknown prompt: {key}")
        if len(values) > 100:
            has_more, total, values = True, total or len(values), values[:100]
        completion: dict[str, JSONValue] = {"values": values, "hasMore": has_more}
        if total is not None:
            completion["total"] = total
        return {"completion": completion}

    async def _listen(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        # The opening runs here; the stream that follows (tritask.server.listen) keeps none of
        # the request: what is built only to open it (the server's capabilities, the
        # acknowledgement) lives in helpers' frames, and a transport that takes the stream
        # over (ctx.hand_off) lets this frame, the request and its own frames go at once.
        stream = await self._open_listen(params, ctx)
        response = {"_meta": dict(stream.tag)}
        if not ctx.hand_off(stream):
            await stream.run(ctx.emit)
        return response

    async def _open_listen(self, params: dict[str, JSONValue], ctx: Context) -> ListenStream:
        """Grant the filter, open the hub subscription, send the acknowledgement and the
        extensions' snapshots: the stream, ready to deliver (closed if the opening fails)."""
        accepted = await self._listen_filter(params, ctx)
        tag: dict[str, JSONValue] = {SUBSCRIPTION_ID_KEY: ctx.request_id}
        hub = self.app.hub
        subscription = hub.open(accepted)
        try:
            for extension in self.app.extensions.values():
                extension.subscription_opened(subscription, ctx)
            await ctx.send_notification(
                "notifications/subscriptions/acknowledged",
                {"_meta": dict(tag), "notifications": dict(accepted)},
            )
            await self._send_snapshots(accepted, ctx, tag)
        except BaseException:
            hub.close_subscription(subscription)
            raise
        return ListenStream(hub, subscription, tag, ctx.detach())

    async def _send_snapshots(
        self, accepted: dict[str, JSONValue], ctx: Context, tag: dict[str, JSONValue]
    ) -> None:
        """The extensions' current state for a new stream (sent after its acknowledgement)."""
        for extension in self.app.extensions.values():
            for method, params in await extension.subscription_snapshot(accepted, ctx):
                snapshot_meta = params.get("_meta")
                merged_meta = dict(snapshot_meta) if isinstance(snapshot_meta, dict) else {}
                merged_meta.update(tag)
                await ctx.send_notification(method, {**params, "_meta": merged_meta})

    async def _listen_filter(
        self, params: dict[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        """What a ``subscriptions/listen`` asks for that this server grants."""
        requested = params.get("notifications")
        if not isinstance(requested, dict):
            raise InvalidParams("subscriptions/listen requires a params.notifications object")
        capabilities = self.app.capabilities()
        accepted: dict[str, JSONValue] = {}
        for key, capability in _LIST_FLAGS.items():
            value = requested.get(key)
            if value is None:
                continue
            if not isinstance(value, bool):
                raise InvalidParams(f"notifications.{key} must be a boolean")
            if value and capability in capabilities:
                accepted[key] = True
        uris = requested.get("resourceSubscriptions")
        if uris is not None:
            if not isinstance(uris, list) or not all(isinstance(u, str) and u for u in uris):
                raise InvalidParams("notifications.resourceSubscriptions must be a list of URIs")
            if "resources" in capabilities and uris:
                accepted["resourceSubscriptions"] = list(dict.fromkeys(uris))
        for extension in self.app.extensions.values():
            accepted.update(await extension.subscription_filter(requested, ctx))
        return accepted
