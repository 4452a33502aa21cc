"""The public surface of tritask, pinned: adding, removing or renaming a public name fails here.

A public name is one re-exported by ``tritask`` or one of its public subpackages (anything not
starting with ``_`` that is not a submodule). Changing this list is a decision about the API:
make it on purpose, in the same commit as the change, and say so in its message.
"""

from __future__ import annotations

import importlib
import types

import pytest

PUBLIC = {
    "tritask": [
        "App",
        "AudioContent",
        "BlobResourceContents",
        "CallToolResult",
        "Completed",
        "ConcurrencyLimit",
        "ConfigurationError",
        "Context",
        "DuplicateStepKey",
        "EmbeddedResource",
        "ExecutionToken",
        "Extension",
        "Failed",
        "GetPromptResult",
        "ImageContent",
        "InputRequired",
        "InternalError",
        "InvalidParams",
        "JsonRpcError",
        "LoggingInstrumentation",
        "MemoryStore",
        "MissingRequiredClientCapability",
        "PromptMessage",
        "ResourceLink",
        "Retry",
        "RetryLater",
        "RetryPolicy",
        "Runner",
        "ServeEnvironment",
        "StepError",
        "StepFailed",
        "StepInterrupted",
        "StepMismatch",
        "StepMisuse",
        "StepTooLarge",
        "TaskOptions",
        "Tasks",
        "TextContent",
        "TextResourceContents",
        "ToolError",
        "TrioClock",
        "Work",
        "WorkExecutor",
        "accepted_content",
        "await_input",
        "elicitation",
        "list_roots",
        "open_store",
        "sampling",
    ],
    "tritask.auth": [
        "AccessToken",
        "BearerAuth",
        "HttpRequest",
        "HttpResponse",
        "InsufficientScope",
        "IntrospectionVerifier",
        "InvalidToken",
        "JWTVerifier",
        "Refusal",
        "TokenVerifier",
        "VerifierUnavailable",
    ],
    "tritask.client": [
        "AuthChallenge",
        "Authorizer",
        "CancelledByServer",
        "Client",
        "ClientCredentials",
        "ClientError",
        "Completion",
        "DEFAULT_CLIENT_INFO",
        "Exchange",
        "HeaderMismatchError",
        "HttpTransport",
        "InputHandler",
        "InputNotHandled",
        "InputRequest",
        "InternalError",
        "InvalidParamsError",
        "InvalidRequestError",
        "MethodNotFoundError",
        "MissingCapabilityError",
        "Notification",
        "OAuthError",
        "ParamHeader",
        "ParseError",
        "Progress",
        "PromptResult",
        "ProtocolViolation",
        "ResourceResult",
        "Roots",
        "RpcError",
        "ServerError",
        "ServerInfo",
        "Subscription",
        "TASKS_EXTENSION",
        "TaskCancelled",
        "TaskHandle",
        "TaskState",
        "Tool",
        "ToolCall",
        "ToolRejected",
        "ToolResult",
        "Transport",
        "TransportError",
        "UnsupportedVersionError",
        "connect",
        "error_from",
        "open_transport",
    ],
    "tritask.server": [
        "App",
        "CallNext",
        "ConfigurationError",
        "Context",
        "Dispatcher",
        "Extension",
        "Hub",
        "InputProvider",
        "InputRequired",
        "NotInTask",
        "RequestStateSealer",
        "RetryLater",
        "ServeEnvironment",
        "ToolCall",
        "ToolDef",
        "ToolError",
        "accepted_content",
        "elicitation",
        "list_roots",
        "sampling",
    ],
    "tritask.testing": [
        "ServeError",
        "ServeProcess",
    ],
    "tritask.tasks": [
        "Completed",
        "ConcurrencyLimit",
        "DuplicateStepKey",
        "EXTENSION_ID",
        "Effects",
        "Event",
        "EventKind",
        "ExecutionToken",
        "Failed",
        "InstrumentationSink",
        "LoggingInstrumentation",
        "MemoryStore",
        "RecordingInstrumentation",
        "Retry",
        "RetryPolicy",
        "RoutingExecutor",
        "Runner",
        "Snapshot",
        "StaleAttempt",
        "StepError",
        "StepFailed",
        "StepInterrupted",
        "StepMismatch",
        "StepMisuse",
        "StepTooLarge",
        "Store",
        "Task",
        "TaskCancelled",
        "TaskOptions",
        "TaskStatus",
        "Tasks",
        "ToolCallExecutor",
        "TrioClock",
        "Work",
        "WorkExecutor",
        "apply",
        "await_input",
        "format_instant",
        "open_store",
        "parse_instant",
    ],
}


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_names_are_exactly_the_pinned_ones(module_name: str) -> None:
    assert public_names(module_name) == PUBLIC[module_name]


def test_every_public_name_of_the_top_package_resolves_to_its_subpackage_object() -> None:
    import tritask
    import tritask.server
    import tritask.tasks

    for name in PUBLIC["tritask"]:
        value = getattr(tritask, name)
        for package in (tritask.server, tritask.tasks):
            if name in PUBLIC[package.__name__]:
                assert getattr(package, name) is value, name
