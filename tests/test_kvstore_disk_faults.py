"""The LMDB disk tier when its disk fails under it: a file that may not grow (a full disk), a data
file cut short. Each case runs in a child process of its own (spawned): a file-size limit must not
reach pytest, and a SIGBUS, were the tier to read past the file's end, must fail the test, not
kill the run."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import resource
import time
from pathlib import Path
from typing import Any

from kvstore.block_format import checksum
from kvstore.disk_tier import DiskTier
from tests.kvstore_fixtures import key, payload
from tests.polling import wait_until

BLOCK = 64 * 1024
LIMIT = 1 << 20  # the disk "fills up" at 1 MiB: about a dozen blocks
_MiB = 1 << 20


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _opened(path: str) -> tuple[DiskTier, list[list[bytes] | None], _Errors]:
    errors = _Errors()
    logging.getLogger("kvstore.disk_tier").addHandler(errors)
    tier = DiskTier(path, 64 * _MiB)
    lost: list[list[bytes] | None] = []
    tier.on_lost = lost.append
    return tier, lost, errors


def _write(tier: DiskTier, i: int) -> None:
    data = payload(i, BLOCK)
    tier.write(key(i), data, checksum(data), ephemeral=False, seq=i + 1)


def _fill_a_disk_that_fills_up(path: str, out: Any) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))  # writes past it fail with EFBIG
    tier, lost, errors = _opened(path)
    flushed = []
    for i in range(40):
        _write(tier, i)
        flushed.append(tier.flush(5))  # one commit per block: each is written, or not, alone
    wait_until(lambda: sum(len(keys or []) for keys in lost) >= tier.failed_writes, interval_s=0.01,
               message="a failed write's blocks were never reported lost")
    readable = [i for i in range(40) if tier.read(key(i)) == payload(i, BLOCK)]
    out.put({
        "failure": tier.failure, "failed_writes": tier.failed_writes, "flushed": flushed,
        "lost": sorted(i for i in range(40) for keys in lost if keys and key(i) in keys),
        "readable": readable, "keys_match": tier.keys() == {key(i) for i in readable},
        "errors": errors.lines,
    })
    tier.delete(key(0))  # after the failure: not committed, but the tier no longer holds it
    tier.flush(5)
    out.put({"deleted_read": tier.read(key(0)), "deleted_listed": key(0) in set(tier.keys())})
    tier.close(5)


def test_a_disk_that_fills_up_stops_taking_blocks_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    first, then = _in_child(_fill_a_disk_that_fills_up, tmp_path / "db", results=2)
    assert first["failure"] and "write failed" in first["failure"], first["failure"]
    readable, lost = first["readable"], first["lost"]
    assert readable and lost and sorted(readable + lost) == list(range(40))  # every block: held, or reported lost
    assert readable == list(range(len(readable)))  # what was written before the disk filled is read back
    assert first["failed_writes"] == len(lost) and first["keys_match"]
    assert first["flushed"] == [True] * len(readable) + [False] * len(lost)  # never durable once writes drop
    assert len(first["errors"]) == 1 and "stopped taking blocks" in first["errors"][0]  # one line, not one a block
    assert then == {"deleted_read": None, "deleted_listed": False}


def _truncate_under_an_open_tier(path: str, out: Any) -> None:
    tier, lost, errors = _opened(path)
    for i in range(20):
        _write(tier, i)
    assert tier.flush(5)
    before = [tier.read(key(i)) == payload(i, BLOCK) for i in range(20)]
    data = Path(path) / "data.mdb"
    os.truncate(data, data.stat().st_size // 3)
    after = [tier.read(key(i)) for i in range(20)]  # LMDB's map past the file's end: SIGBUS, unless checked
    _write(tier, 99)
    flushed = tier.flush(5)
    wait_until(lambda: None in lost, interval_s=0.01, message="the tier never reported all its blocks lost")
    out.put({"before": before, "after": after, "failure": tier.failure, "keys": tier.keys(), "flushed": flushed,
             "lost_all": None in lost, "failed_writes": tier.failed_writes, "errors": errors.lines})
    tier.close(5)


def test_a_data_file_cut_short_under_an_open_tier_is_damage_not_sigbus(tmp_path: Path) -> None:
    (got,) = _in_child(_truncate_under_an_open_tier, tmp_path / "db")
    assert got["before"] == [True] * 20
    assert got["after"] == [None] * 20 and got["keys"] == set()
    assert "cut to" in got["failure"] and got["lost_all"] and not got["flushed"] and got["failed_writes"] == 1
    assert len(got["errors"]) == 1
    reopened = DiskTier(tmp_path / "db", 64 * _MiB)  # the next start moves it aside
    try:
        assert reopened.quarantined is not None and reopened.keys() == set()
    finally:
        reopened.close()


def _in_child(target: Any, path: Path, results: int = 1) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(str(path), out))
    child.start()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    try:
        while len(got) < results and time.monotonic() < deadline:
            try:
                got.append(out.get(timeout=0.1))
            except queue.Empty:
                if not child.is_alive() and out.empty():
                    break  # it died (a SIGBUS is exit code -7)
    finally:
        child.join(30)
    assert child.exitcode == 0 and len(got) == results, f"the child died with exit code {child.exitcode}"
    return got
