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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, empty (tests/redis_fixtures.py). Tests that use it are marked
    `needs_redis`: skipped where redis-server is not installed."""
    with RedisServer.start(tmp_path) as server:
        yield server
