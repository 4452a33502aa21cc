"""A trio-native MCP 2026-07-28 client with the Tasks extension (SEP-2663).

``async with connect(url_or_command) as client:`` then ``await client.call_tool(name, args)``,
which follows a task to its result; ``await client.start_tool(...)`` returns a handle instead.
The server never imports this package; it shares only ``tritask.protocol`` and
``tritask.jsonrpc`` with it.
"""

from tritask.client.client import (
    DEFAULT_CLIENT_INFO as DEFAULT_CLIENT_INFO,
)
from tritask.client.client import (
    Client as Client,
)
from tritask.client.client import (
    InputHandler as InputHandler,
)
from tritask.client.client import (
    Roots as Roots,
)
from tritask.client.client import (
    Subscription as Subscription,
)
from tritask.client.connect import connect as connect
from tritask.client.connect import open_transport as open_transport
from tritask.client.errors import (
    CancelledByServer as CancelledByServer,
)
from tritask.client.errors import (
    ClientError as ClientError,
)
from tritask.client.errors import (
    HeaderMismatchError as HeaderMismatchError,
)
from tritask.client.errors import (
    InputNotHandled as InputNotHandled,
)
from tritask.client.errors import (
    InternalError as InternalError,
)
from tritask.client.errors import (
    InvalidParamsError as InvalidParamsError,
)
from tritask.client.errors import (
    InvalidRequestError as InvalidRequestError,
)
from tritask.client.errors import (
    MethodNotFoundError as MethodNotFoundError,
)
from tritask.client.errors import (
    MissingCapabilityError as MissingCapabilityError,
)
from tritask.client.errors import (
    ParseError as ParseError,
)
from tritask.client.errors import (
    ProtocolViolation as ProtocolViolation,
)
from tritask.client.errors import (
    RpcError as RpcError,
)
from tritask.client.errors import (
    ServerError as ServerError,
)
from tritask.client.errors import (
    TaskCancelled as TaskCancelled,
)
from tritask.client.errors import (
    ToolRejected as ToolRejected,
)
from tritask.client.errors import (
    TransportError as TransportError,
)
from tritask.client.errors import (
    UnsupportedVersionError as UnsupportedVersionError,
)
from tritask.client.errors import (
    error_from as error_from,
)
from tritask.client.http import AuthChallenge as AuthChallenge
from tritask.client.http import Authorizer as Authorizer
from tritask.client.http import HttpTransport as HttpTransport
from tritask.client.model import (
    TASKS_EXTENSION as TASKS_EXTENSION,
)
from tritask.client.model import (
    Completion as Completion,
)
from tritask.client.model import (
    InputRequest as InputRequest,
)
from tritask.client.model import (
    Notification as Notification,
)
from tritask.client.model import (
    ParamHeader as ParamHeader,
)
from tritask.client.model import (
    Progress as Progress,
)
from tritask.client.model import (
    PromptResult as PromptResult,
)
from tritask.client.model import (
    ResourceResult as ResourceResult,
)
from tritask.client.model import (
    ServerInfo as ServerInfo,
)
from tritask.client.model import (
    TaskState as TaskState,
)
from tritask.client.model import (
    Tool as Tool,
)
from tritask.client.model import (
    ToolResult as ToolResult,
)
from tritask.client.oauth import ClientCredentials as ClientCredentials
from tritask.client.oauth import OAuthError as OAuthError
from tritask.client.tasks import TaskHandle as TaskHandle
from tritask.client.tasks import ToolCall as ToolCall
from tritask.client.transport import Exchange as Exchange
from tritask.client.transport import Transport as Transport
