"""``@app.tool`` and ``@app.prompt`` register the function bare and called alike."""

from __future__ import annotations

import pytest

from tritask.server.app import App


def test_bare_and_called_tool_decorators_register_and_return_the_function() -> None:
    app = App("decorators", "1.0.0")

    @app.tool
    async def bare(text: str) -> str:
        """Registered without parentheses."""
        return text

    @app.tool()
    async def called(text: str) -> str:
        """Registered with parentheses."""
        return text

    @app.tool("renamed", description="Registered under another name.")
    async def original() -> str:
        return "x"

    assert list(app.tools) == ["bare", "called", "renamed"]
    assert app.tools["bare"].fn is bare
    assert app.tools["bare"].description == "Registered without parentheses."
    assert app.tools["renamed"].fn is original
    assert bare.__name__ == "bare"  # the decorator hands back the function itself


def test_bare_and_called_prompt_decorators() -> None:
    app = App("decorators", "1.0.0")

    @app.prompt
    async def hello(name: str) -> str:
        """Say hello."""
        return f"hello {name}"

    @app.prompt("bye")
    async def farewell() -> str:
        """Say goodbye."""
        return "bye"

    assert list(app.prompts) == ["hello", "bye"]
    assert app.prompts["hello"].fn is hello
    assert [argument.name for argument in app.prompts["hello"].arguments] == ["name"]


def test_a_bare_decorator_still_checks_the_function() -> None:
    app = App("decorators", "1.0.0")
    with pytest.raises(ValueError, match="needs a description"):

        @app.tool
        async def undocumented() -> str:
            return ""

    assert app.tools == {}
