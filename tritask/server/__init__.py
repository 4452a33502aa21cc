"""The MCP server core: ``App``, request ``Context``, dispatcher, MRTR and the listen hub."""

from tritask.server.app import App as App
from tritask.server.app import ToolDef as ToolDef
from tritask.server.context import Context as Context
from tritask.server.context import InputProvider as InputProvider
from tritask.server.context import NotInTask as NotInTask
from tritask.server.dispatcher import Dispatcher as Dispatcher
from tritask.server.extension import CallNext as CallNext
from tritask.server.extension import ConfigurationError as ConfigurationError
from tritask.server.extension import Extension as Extension
from tritask.server.extension import ServeEnvironment as ServeEnvironment
from tritask.server.extension import ToolCall as ToolCall
from tritask.server.hub import Hub as Hub
from tritask.server.mrtr import InputRequired as InputRequired
from tritask.server.mrtr import RequestStateSealer as RequestStateSealer
from tritask.server.mrtr import accepted_content as accepted_content
from tritask.server.mrtr import elicitation as elicitation
from tritask.server.mrtr import list_roots as list_roots
from tritask.server.mrtr import sampling as sampling
from tritask.server.results import RetryLater as RetryLater
from tritask.server.results import ToolError as ToolError
