"""Fixtures for the OAuth tests: a test authorization server on loopback, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.importorskip("joserfc")

from tritask.testing.oauth import TestAuthorizationServer, running_authorization_server

RESOURCE = "https://mcp.example.com/mcp"


@pytest.fixture
async def auth_server() -> AsyncIterator[TestAuthorizationServer]:
    async with running_authorization_server() as server:
        yield server
