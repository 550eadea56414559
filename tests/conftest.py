"""Fixtures more than one test file asks for. What tests share besides fixtures is in modules they import
by name: `tests/polling.py` (`wait_until`, the one way a test waits), `tests/processes.py` (ports and
processes), and the helpers of each part in `tests/*_fixtures.py`, `tests/fake_decode.py` and
`tests/model_faults.py`."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.local import HOME_ENV
from kvserve.engine.fetch import DATA_DIR_ENV
from tests.polling import wait_until
from tests.processes import KVSERVE, alive, children, free_ports
from tests.redis_fixtures import RedisServer
from tests.stack_fixtures import model_dir

# The session's own folders, never the checkout's data/ nor the user's ~/.kvserve, so that a `kvserve up` the
# developer runs is invisible to the tests: the data dir that commands default to (kvserve/engine/fetch.py: models,
# up.json), and where a `kvserve up` names its credentials for local clients (client/local.py). Set at import,
# so that every process the tests start inherits them; each test worker has its own.
_SESSION = Path(tempfile.mkdtemp(prefix="kvserve-tests-"))
atexit.register(shutil.rmtree, _SESSION, ignore_errors=True)
os.environ[DATA_DIR_ENV] = str(_SESSION / "data")  # made by what writes there first, as in a fresh checkout
os.environ[HOME_ENV] = str(_SESSION / "home")

# The tests run many engine processes at once on few cores (two workers, each with its stacks and its own torch),
# so an OpenMP thread that spins while it waits for its team burns a core another process needs. With threads that
# sleep at once, four stack-heavy files took 110-121 s instead of 144-159 s on 2 cores, with 0.6x the CPU time. Set
# before torch loads libgomp, in the workers and in every service they start; a service deployed alone keeps
# OpenMP's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, empty (tests/redis_fixtures.py). Tests that use it are marked
    `needs_redis`: skipped where redis-server is not installed."""
    with RedisServer.start(tmp_path) as server:
        yield server


@pytest.fixture()
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str], list[str], Path, list[int]]]:
    """A secure `kvserve up` on the tiny model, with the HTTP API, ready; its stdout and stderr lines as they come,
    its data dir and its ports: decode, prefill, store, HTTP."""
    data, ports = tmp_path / "data", free_ports(4)
    proc = subprocess.Popen(
        [KVSERVE, "up", "--data-dir", str(data), "--model", str(model_dir("llama")), "--decode-port", str(ports[0]),
         "--prefill-port", str(ports[1]), "--store-port", str(ports[2]), "--http-port", str(ports[3])],
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: list[str] = []
    err: list[str] = []
    for stream, lines in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=lambda s=stream, lines=lines: lines.extend(s), daemon=True).start()
    seen: set[int] = set()
    try:
        def ready() -> bool:
            assert proc.poll() is None, "".join(err)
            seen.update(children(proc.pid))
            return any(line.startswith("ready:") for line in out)

        wait_until(ready, 180, interval_s=0.1, message=lambda: "".join(out + err))
        yield proc, out, err, data, ports
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in seen | set(children(proc.pid)):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
