"""The tool-argument contract: which wire arguments a tool's function can be called with.

A tool advertises a schema and is called as ``fn(**arguments)``. If the two disagree, a client
that follows the schema (or one that makes a typo) gets a ``TypeError`` from the call: a 500 on
a direct call, a failed task after one was created. So the contract is derived once, when the
tool is registered, and checked before anything runs or is stored:

- A name the function cannot take (not one of its keyword parameters, not absorbed by
  ``**kwargs``; the context parameter is never a wire argument) is refused with ``-32602``
  naming it, when the schema was generated from the signature. Generated schemas say
  ``additionalProperties: false`` for such functions, so the listing tells clients the same.
- When the tool declares its own ``input_schema``, that schema is the contract the client sees:
  what it forbids is refused by schema validation (an ``isError`` result, like every schema
  error), and what it allows but the function cannot take is dropped before the call; a
  function with ``**kwargs`` receives every extra. Registration refuses an explicit schema that
  declares a property the function cannot take (an advertised argument that would always be
  dropped is a mistake, not a policy).
- A parameter without a default that the arguments lack is refused with ``-32602`` naming it
  (only an explicit schema can fail to require it; a generated schema's ``required`` already
  lists it, so that is a schema error).

The same check runs when recovered task work is executed, so work stored by an older version of
a tool fails its task with the same message instead of a ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from tritask.jsonrpc import InvalidParams, JSONValue

_MAX_NAMED = 10
_MAX_NAME_CHARS = 64


def _quoted(name: str) -> str:
    """``repr`` of a client-chosen name, cut short: messages stay bounded and printable."""
    if len(name) > _MAX_NAME_CHARS:
        name = name[: _MAX_NAME_CHARS - 3] + "..."
    return repr(name)


def _names(names: list[str]) -> str:
    shown = ", ".join(_quoted(name) for name in names[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


@attrs.frozen(kw_only=True)
class ArgumentContract:
    """What one tool function accepts, derived from its signature at registration."""

    tool: str
    parameters: frozenset[str]
    """Keyword-passable parameters, the context parameter excluded."""
    required: tuple[str, ...]
    """Parameters without a default, in signature order."""
    var_keyword: bool
    """The function takes ``**kwargs``: it can take any name but the context parameter."""
    context_param: str | None
    explicit_schema: bool
    """The tool declared its ``input_schema``: extras it allows are dropped, not refused."""

    @classmethod
    def of(
        cls,
        tool: str,
        fn: Callable[..., Any],
        *,
        context_param: str | None,
        input_schema: Mapping[str, JSONValue] | None,
    ) -> ArgumentContract:
        """The contract of ``fn``; ``input_schema`` is the explicit schema, if one was given.

        Raises ``TypeError`` for a positional-only parameter (tools are called by keyword) and
        ``ValueError`` for an explicit schema naming a property the function cannot take.
        """
        parameters: set[str] = set()
        required: list[str] = []
        var_keyword = False
        for parameter in inspect.signature(fn).parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                var_keyword = True
                continue
            if parameter.kind is parameter.VAR_POSITIONAL:
                continue
            if parameter.kind is parameter.POSITIONAL_ONLY:
                raise TypeError(
                    f"tool {tool!r}: parameter {parameter.name!r} is positional-only; "
                    "tools are called with keyword arguments"
                )
            if parameter.name == context_param:
                continue
            parameters.add(parameter.name)
            if parameter.default is inspect.Parameter.empty:
                required.append(parameter.name)
        contract = cls(
            tool=tool,
            parameters=frozenset(parameters),
            required=tuple(required),
            var_keyword=var_keyword,
            context_param=context_param,
            explicit_schema=input_schema is not None,
        )
        if input_schema is not None:
            contract._check_schema(input_schema)
        return contract

    def _check_schema(self, schema: Mapping[str, JSONValue]) -> None:
        properties = schema.get("properties")
        declared: list[str] = list(properties) if isinstance(properties, dict) else []
        listed = schema.get("required")
        if isinstance(listed, list):
            declared += [name for name in listed if isinstance(name, str)]
        untakeable = self.untakeable(dict.fromkeys(declared))
        if untakeable:
            raise ValueError(
                f"tool {self.tool!r}: input_schema declares {_names(untakeable)}, "
                "which the function cannot take"
            )

    def takes(self, name: str) -> bool:
        if name == self.context_param:
            return False
        return name in self.parameters or self.var_keyword

    def untakeable(self, names: Iterable[str]) -> list[str]:
        """The names the function cannot be called with, in the order given."""
        return [name for name in names if not self.takes(name)]

    def refuse_unknown(self, arguments: Mapping[str, JSONValue]) -> None:
        """``-32602`` for names the function cannot take (generated schemas only).

        Runs before schema validation, so the answer names the argument rather than quoting a
        schema message, and decides before any side effect (a task is never created).
        """
        if self.explicit_schema:
            return
        unknown = self.untakeable(arguments)
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise InvalidParams(
                f"unknown argument{plural} {_names(unknown)} for tool {self.tool!r}",
                {"tool": self.tool, "unknown": [_quoted(n)[1:-1] for n in unknown[:_MAX_NAMED]]},
            )

    def admit(self, arguments: dict[str, JSONValue]) -> dict[str, JSONValue]:
        """The arguments the function is called with (schema-valid ones in, extras dropped).

        Raises ``-32602`` for a required parameter the arguments lack.
        """
        missing = [name for name in self.required if name not in arguments]
        if missing:
            plural = "s" if len(missing) > 1 else ""
            raise InvalidParams(
                f"missing argument{plural} {_names(missing)} for tool {self.tool!r}",
                {"tool": self.tool, "missing": missing},
            )
        if all(self.takes(name) for name in arguments):
            return arguments
        return {name: value for name, value in arguments.items() if self.takes(name)}
