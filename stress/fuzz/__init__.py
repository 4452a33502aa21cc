"""A black-box fuzzer for a served MCP app: valid envelopes, generated parameters.

Framing fuzzers (``tests/transports/test_http_fuzz.py``) stop at the transport; this one gets
past it. Every request has a correct 2026-07-28 envelope (``_meta`` with the protocol version
and client capabilities, and on HTTP the ``MCP-Protocol-Version``, ``Mcp-Method``, ``Mcp-Name``
and ``Mcp-Param-*`` headers a client would send), so it reaches the handlers with generated
parameters: tool arguments derived from each tool's advertised schema and then bent, input
responses, task ids the server really issued, resource URIs, prompt arguments, completion
references and listen filters. What must hold, whatever the parameters:

- no HTTP 5xx and no ``-32603`` answer, every answer a well-formed JSON-RPC message;
- no traceback in the server log (the one deliberate crash of the fixture excepted);
- every task created from generated arguments reaches a state its tool implies
  (``TASK_OUTCOMES``), never a failure with an internal error;
- the server still answers afterwards.

It only talks to a socket or a process (``drivers``), discovers the app through its lists, and
is driven by Hypothesis strategies (``strategies``), so the test suite shrinks what it finds and
``python -m stress fuzz`` runs thousands of requests against a ``tritask serve`` process. The
envelope is an ``Era`` (``eras``): ``MODERN``, or a ``LegacyEra`` session (``initialize`` once
per connection, ``Mcp-Session-Id`` on HTTP, the legacy methods, and the server's own requests
answered with the results and errors each step drew).
"""

from stress.fuzz.eras import MODERN as MODERN
from stress.fuzz.eras import Era as Era
from stress.fuzz.eras import LegacyEra as LegacyEra
from stress.fuzz.eras import legacy_era as legacy_era
from stress.fuzz.session import Fuzzer as Fuzzer
from stress.fuzz.session import Ledger as Ledger
