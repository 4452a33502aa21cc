"""tritask: a trio-native MCP 2026-07-28 server runtime with durable Tasks (SEP-2663)."""

from importlib import metadata as _metadata

from tritask.jsonrpc import InternalError as InternalError
from tritask.jsonrpc import InvalidParams as InvalidParams
from tritask.jsonrpc import JsonRpcError as JsonRpcError
from tritask.protocol.errors import (
    MissingRequiredClientCapability as MissingRequiredClientCapability,
)
from tritask.protocol.wire import AudioContent as AudioContent
from tritask.protocol.wire import BlobResourceContents as BlobResourceContents
from tritask.protocol.wire import CallToolResult as CallToolResult
from tritask.protocol.wire import EmbeddedResource as EmbeddedResource
from tritask.protocol.wire import GetPromptResult as GetPromptResult
from tritask.protocol.wire import ImageContent as ImageContent
from tritask.protocol.wire import PromptMessage as PromptMessage
from tritask.protocol.wire import ResourceLink as ResourceLink
from tritask.protocol.wire import TextContent as TextContent
from tritask.protocol.wire import TextResourceContents as TextResourceContents
from tritask.server import App as App
from tritask.server import ConfigurationError as ConfigurationError
from tritask.server import Context as Context
from tritask.server import Extension as Extension
from tritask.server import InputRequired as InputRequired
from tritask.server import RetryLater as RetryLater
from tritask.server import ServeEnvironment as ServeEnvironment
from tritask.server import ToolError as ToolError
from tritask.server import accepted_content as accepted_content
from tritask.server import elicitation as elicitation
from tritask.server import list_roots as list_roots
from tritask.server import sampling as sampling
from tritask.tasks import Completed as Completed
from tritask.tasks import ConcurrencyLimit as ConcurrencyLimit
from tritask.tasks import DuplicateStepKey as DuplicateStepKey
from tritask.tasks import ExecutionToken as ExecutionToken
from tritask.tasks import Failed as Failed
from tritask.tasks import LoggingInstrumentation as LoggingInstrumentation
from tritask.tasks import MemoryStore as MemoryStore
from tritask.tasks import Retry as Retry
from tritask.tasks import RetryPolicy as RetryPolicy
from tritask.tasks import Runner as Runner
from tritask.tasks import StepError as StepError
from tritask.tasks import StepFailed as StepFailed
from tritask.tasks import StepInterrupted as StepInterrupted
from tritask.tasks import StepMismatch as StepMismatch
from tritask.tasks import StepMisuse as StepMisuse
from tritask.tasks import StepTooLarge as StepTooLarge
from tritask.tasks import TaskOptions as TaskOptions
from tritask.tasks import Tasks as Tasks
from tritask.tasks import TrioClock as TrioClock
from tritask.tasks import Work as Work
from tritask.tasks import WorkExecutor as WorkExecutor
from tritask.tasks import await_input as await_input
from tritask.tasks import open_store as open_store

try:  # the version is written once, in pyproject.toml
    __version__ = _metadata.version("tritask")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
