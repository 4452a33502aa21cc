"""Test helpers for tritask and for third-party stores (never imported by runtime code).

Re-exported here: :class:`ServeProcess` (a real ``tritask serve`` process, ready once it has
reported its URLs) and :class:`ServeError`. The other helpers live in their submodules:
``store_contract`` (the store contract suite), ``client`` (a small 2026-07-28 client),
``oauth`` (a loopback authorization server), ``pytest_contract`` (the contract-group plugin).
"""

from tritask.testing.serve import ServeError, ServeProcess

__all__ = ["ServeError", "ServeProcess"]
