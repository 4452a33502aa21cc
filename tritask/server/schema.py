"""Input schemas for tools: derived from a function signature, or given, then enforced.

Arguments are validated with JSON Schema 2020-12 exactly as a direct call would be, before any
side effect (and before the Tasks extension stores anything).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

import jsonschema
from jsonschema.validators import Draft202012Validator

from tritask.jsonrpc import JSONValue

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def type_schema(annotation: Any) -> dict[str, JSONValue]:
    """JSON Schema for a Python annotation (the common subset tool authors use)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        base, *extras = get_args(annotation)
        schema = type_schema(base)
        for extra in extras:
            if isinstance(extra, str):
                schema["description"] = extra
            elif isinstance(extra, dict):
                schema.update(extra)
        return schema
    if isinstance(annotation, type) and annotation in _SCALARS:
        # Only classes are looked up: generic aliases may hold unhashable metadata.
        return {"type": _SCALARS[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    if origin is Literal:
        return {"enum": list(get_args(annotation))}
    if origin in (Union, types.UnionType):
        members = get_args(annotation)
        non_null = [member for member in members if member is not type(None)]
        if len(non_null) == 1 and len(members) == 2:
            inner = type_schema(non_null[0])
            if "type" in inner and isinstance(inner["type"], str):
                return {**inner, "type": [inner["type"], "null"]}
            return {"anyOf": [inner, {"type": "null"}]}
        return {"anyOf": [type_schema(member) for member in members]}
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        args = get_args(annotation)
        schema = {"type": "array"}
        if origin is tuple and args and args[-1] is not Ellipsis:
            # A fixed-length tuple: one schema per position.
            schema["prefixItems"] = [type_schema(arg) for arg in args]
            schema["items"] = False
            schema["minItems"] = schema["maxItems"] = len(args)
        elif args:
            schema["items"] = type_schema(args[0])
        return schema
    if origin is dict or annotation is dict:
        args = get_args(annotation)
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = type_schema(args[1])
        return schema
    raise TypeError(f"cannot derive a JSON schema for {annotation!r}; pass input_schema=")


def signature_schema(
    fn: Callable[..., Any], skip: Callable[[inspect.Parameter, Any], bool]
) -> tuple[dict[str, JSONValue], list[str]]:
    """An object schema for ``fn``'s parameters, and the names of those it accepts.

    The schema says ``additionalProperties: false`` unless ``fn`` takes ``**kwargs``: it is
    what the function can be called with, so a client reading it knows extras are refused.
    """
    hints = typing.get_type_hints(fn, include_extras=True)
    properties: dict[str, JSONValue] = {}
    required: list[str] = []
    names: list[str] = []
    var_keyword = False
    for parameter in inspect.signature(fn).parameters.values():
        annotation = hints.get(parameter.name, parameter.annotation)
        if parameter.kind is parameter.VAR_KEYWORD:
            var_keyword = True
            continue
        if skip(parameter, annotation):
            continue
        if parameter.kind is parameter.VAR_POSITIONAL:
            continue
        schema = type_schema(annotation)
        if parameter.default is not inspect.Parameter.empty:
            if parameter.default is not None or "null" in str(schema.get("type", "")):
                schema["default"] = parameter.default
        else:
            required.append(parameter.name)
        properties[parameter.name] = schema
        names.append(parameter.name)
    result: dict[str, JSONValue] = {"type": "object", "properties": properties}
    if required:
        result["required"] = required
    if not var_keyword:
        result["additionalProperties"] = False
    return result, names


def compile_validator(schema: Mapping[str, JSONValue]) -> Draft202012Validator:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError('a tool inputSchema must be an object schema with "type": "object"')
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def validation_errors(validator: Draft202012Validator, arguments: JSONValue) -> list[str]:
    """Readable messages naming where the arguments are wrong (bounded, no internals)."""
    messages: list[str] = []
    try:
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    except (jsonschema.exceptions.SchemaError, RecursionError):
        return ["arguments could not be validated"]
    for error in errors[:10]:
        where = "/".join(str(part) for part in error.absolute_path) or "arguments"
        message = error.message
        if len(message) > 200:
            message = message[:197] + "..."
        messages.append(f"{where}: {message}")
    return messages
