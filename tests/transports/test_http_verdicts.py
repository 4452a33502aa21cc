"""The HTTP transport remembers its Host and Accept verdicts per value, and stays exact.

Every request sends the same few values, so ``HttpTransport`` computes each verdict once; these
tests pin that a remembered verdict never outlives the configuration it was computed for and
that values past the bound are still judged (only not remembered).
"""

from __future__ import annotations

from tritask.protocol.headers import HeaderView
from tritask.server import App
from tritask.transports import http
from tritask.transports.http import HttpTransport


def view(**headers: str | tuple[str, ...]) -> HeaderView:
    return HeaderView({k: (v,) if isinstance(v, str) else v for k, v in headers.items()})


def test_host_verdicts_follow_a_changed_allowed_hosts() -> None:
    transport = HttpTransport(App("t", "1"))
    assert transport._host_allowed(view(host="localhost:8080"))
    assert not transport._host_allowed(view(host="evil.example"))
    assert transport._host_allowed(view(host="LOCALHOST"))
    transport.options.allowed_hosts = ("evil.example",)
    assert not transport._host_allowed(view(host="localhost:8080"))
    assert transport._host_allowed(view(host="evil.example"))
    transport.options.allowed_hosts = None
    assert transport._host_allowed(view(host="anything"))
    assert transport._host_allowed(view())
    transport.options.allowed_hosts = ("a.example",)
    assert not transport._host_allowed(view())  # no Host at all


def test_verdicts_past_the_bound_are_judged_but_not_kept() -> None:
    transport = HttpTransport(App("t", "1"))
    for n in range(http._VERDICTS_KEPT + 10):
        assert not transport._host_allowed(view(host=f"h{n}.example"))
        assert transport._accepted(view(accept=f"application/json, text/event-stream;q={n}"))
        assert not transport._accepted(view(accept=f"text/html;level={n}"))
    assert len(transport._host_verdicts) == http._VERDICTS_KEPT
    assert len(transport._accept_verdicts) == http._VERDICTS_KEPT
    assert transport._host_allowed(view(host="127.0.0.1:1"))
    assert not transport._accepted(view(accept="application/json"))
    assert transport._accepted(view(accept=("application/json", "text/event-stream")))
    assert transport._accepted(view(accept="*/*"))
