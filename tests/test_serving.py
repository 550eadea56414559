"""The server plumbing every service shares: taken ports fail loudly, and start-up errors are one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.serving import Server


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
