"""OAuth 2.1 resource-server authorization for tritask's HTTP transport (``tritask[oauth]``).

::

    from tritask.auth import BearerAuth, JWTVerifier

    auth = BearerAuth(
        resource="https://mcp.example.com/mcp",
        authorization_servers=["https://auth.example.com"],
        verifier=JWTVerifier("https://auth.example.com", "https://auth.example.com/jwks"),
        required_scopes=["mcp"],
    )
    app = App("files", "1.0", auth=auth)       # or HttpOptions(auth=auth)

Importing this package needs nothing beyond tritask's own dependencies: ``joserfc`` (JWT) is
imported when a JWT is first verified. The security model is in ``docs/security.md``.
"""

from tritask.auth._verifier import HttpRequest as HttpRequest
from tritask.auth._verifier import HttpResponse as HttpResponse
from tritask.auth._verifier import InvalidToken as InvalidToken
from tritask.auth._verifier import TokenVerifier as TokenVerifier
from tritask.auth._verifier import VerifierUnavailable as VerifierUnavailable
from tritask.auth.bearer import BearerAuth as BearerAuth
from tritask.auth.bearer import Refusal as Refusal
from tritask.auth.introspection import IntrospectionVerifier as IntrospectionVerifier
from tritask.auth.jwt import JWTVerifier as JWTVerifier
from tritask.protocol.auth import AccessToken as AccessToken
from tritask.protocol.auth import InsufficientScope as InsufficientScope
