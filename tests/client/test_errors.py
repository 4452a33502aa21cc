"""One exception class per JSON-RPC error code, carrying the server's message and data."""

from __future__ import annotations

import pytest

from tritask.client import (
    ClientError,
    HeaderMismatchError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    MethodNotFoundError,
    MissingCapabilityError,
    ParseError,
    RpcError,
    ServerError,
    UnsupportedVersionError,
    error_from,
)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (-32700, ParseError),
        (-32600, InvalidRequestError),
        (-32601, MethodNotFoundError),
        (-32602, InvalidParamsError),
        (-32603, InternalError),
        (-32020, HeaderMismatchError),
        (-32021, MissingCapabilityError),
        (-32022, UnsupportedVersionError),
        (-32000, ServerError),
        (42, ServerError),
    ],
)
def test_each_code_has_its_class(code: int, cls: type[RpcError]) -> None:
    error = error_from(
        {"code": code, "message": "m", "data": {"k": [1]}}, http_status=400, method="tools/call"
    )
    assert type(error) is cls
    assert isinstance(error, RpcError) and isinstance(error, ClientError)
    assert (error.code, error.message, error.data) == (code, "m", {"k": [1]})
    assert (error.http_status, error.method, error.task_id) == (400, "tools/call", None)
    assert error.to_error() == {"code": code, "message": "m", "data": {"k": [1]}}
    assert str(error) == f"{code}: m"


def test_typed_data_accessors() -> None:
    missing = error_from(
        {"code": -32021, "message": "x", "data": {"requiredCapabilities": {"sampling": {}}}}
    )
    assert isinstance(missing, MissingCapabilityError)
    assert missing.required == {"sampling": {}}
    version = error_from(
        {"code": -32022, "message": "x", "data": {"supported": ["2026-07-28", 3], "requested": "v"}}
    )
    assert isinstance(version, UnsupportedVersionError)
    assert version.supported == ("2026-07-28",)
    assert error_from({"code": -32021, "message": "x"}).required == {}  # type: ignore[attr-defined]


def test_malformed_error_objects_are_still_reported() -> None:
    assert type(error_from("boom")) is ServerError
    weird = error_from({"code": True, "message": 5})
    assert (type(weird), weird.code, weird.message) == (InternalError, -32603, "")
    task = error_from({"code": -32603, "message": "Task tool failed"}, task_id="t-1")
    assert str(task) == "-32603: Task tool failed (task t-1)"
