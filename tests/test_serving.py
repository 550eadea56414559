"""The server plumbing every service shares: taken ports fail loudly, and start-up errors are one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from engine.model import ContextLengthError
from kvstore.errors import InvalidRequest
from serving.errors import FailedPrecondition, InvalidArgument, Unavailable, status_of
from serving.metrics import outcome_of
from serving.server import Server


def test_a_taken_port_is_refused_not_shared() -> None:
    first = Server("127.0.0.1:0")
    port = first.start()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            Server(f"127.0.0.1:{port}").start()
    finally:
        first.stop(0)


def test_a_taken_metrics_port_is_refused_before_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Server("127.0.0.1:0", metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError, match="cannot serve metrics on port"):
            server.start()
        assert server.port == 0


@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_a_missing_model_is_one_line_and_exit_2(module: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--model", str(tmp_path / "nothing"), "--listen",
                           "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no model at" in proc.stderr and "Traceback" not in proc.stderr


class _NamesItsStatus(Exception):
    grpc_status = "NOT_FOUND"  # how domain code free of grpc names its status


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (FailedPrecondition("other model"), grpc.StatusCode.FAILED_PRECONDITION),
        (Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (_NamesItsStatus("gone"), grpc.StatusCode.NOT_FOUND),
        (ContextLengthError("too long"), grpc.StatusCode.OUT_OF_RANGE),
        (InvalidRequest("bad hash"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("a bug of ours"), grpc.StatusCode.INTERNAL),  # never the caller's INVALID_ARGUMENT
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_one_mapping_from_exception_to_status_and_outcome(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_of(exc) == code
    assert outcome_of(exc) == code.name.lower()


def test_outcome_of_a_request_that_ended_normally_or_was_abandoned() -> None:
    assert outcome_of(None) == "ok"
    assert outcome_of(GeneratorExit()) == "cancelled"


def _fail_with(exc: Exception) -> Callable[[object, grpc.ServicerContext], object]:
    def handler(request: object, context: grpc.ServicerContext) -> object:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "code", "details"),
    [
        (InvalidArgument("the prompt is empty"), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
        (ValueError("oops"), grpc.StatusCode.INTERNAL, "internal error: ValueError: oops"),
    ],
)
def test_the_interceptor_ends_an_rpc_with_the_mapped_status(exc: Exception, code: grpc.StatusCode, details: str) -> None:
    server = Server("127.0.0.1:0")
    handler = grpc.method_handlers_generic_handler(
        "test.Probe", {"Call": grpc.unary_unary_rpc_method_handler(_fail_with(exc))}
    )
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None, "test.Probe")
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Probe/Call", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                call(b"", timeout=10)
        assert info.value.code() == code  # type: ignore[attr-defined]
        assert info.value.details() == details  # type: ignore[attr-defined]
    finally:
        server.stop(0)
