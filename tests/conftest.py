"""Fixtures more than one test file asks for. What tests share besides fixtures is in modules they import
by name: `tests/polling.py` (`wait_until`, the one way a test waits), `tests/processes.py` (ports and
processes), and the helpers of each part in `tests/*_fixtures.py`, `tests/fake_decode.py` and
`tests/model_faults.py`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_fixtures import RedisServer

# Where a `kvserve up` started by a test names its credentials for local clients (client/local.py): the
# session's own folder, never the user's ~/.kvserve. Set at import, so that every process the tests start
# inherits it.
os.environ["KVSERVE_HOME"] = tempfile.mkdtemp(prefix="kvserve-home-")

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
