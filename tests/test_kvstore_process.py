"""`python -m kvstore` as a real process: SIGTERM flushes memory to disk, SIGKILL never corrupts it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvstore import KVStoreClient, bench
from kvstore.__main__ import main
from tests.kvstore_fixtures import key, payload, start_process


def args(tmp: Path) -> list[str]:
    return ["--host-capacity", "64KiB", "--disk-capacity", "16MiB", "--disk-path", str(tmp / "db"), "--shm-root", str(tmp)]


def test_sigterm_flushes_and_restart_is_warm(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 10_000)) for i in range(20)]  # 200 kB: most on disk, the rest in host
    proc, port = start_process(args(tmp_path))
    with KVStoreClient(f"127.0.0.1:{port}") as c:
        assert c.put(blocks) == 20
        assert c.stats().tier("host").blocks > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not list(tmp_path.glob("kvserve-*"))  # shm dir cleaned up

    proc, port = start_process(args(tmp_path))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.stats().tier("disk").blocks == 20
            assert c.lookup([k for k, _ in blocks]).num_hits == 20
            assert c.get([k for k, _ in blocks]) == [p for _, p in blocks]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sigkill_never_corrupts_the_disk_tier(tmp_path: Path) -> None:
    proc, port = start_process(args(tmp_path))
    with KVStoreClient(f"127.0.0.1:{port}") as c:
        for n in range(5):
            c.put([(key(f"{n}-{i}"), payload(f"{n}-{i}", 10_000)) for i in range(10)])
        time.sleep(0.5)  # let the disk writer commit what was demoted
        on_disk = c.stats().tier("disk").blocks
        assert on_disk > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    proc, port = start_process(args(tmp_path))  # LMDB opens cleanly, stale shm dir is removed
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            stats = c.stats()
            assert stats.tier("disk").blocks == on_disk
            assert stats.tier("host").blocks == 0  # memory-only blocks are lost, nothing else
            names = [f"{n}-{i}" for n in range(5) for i in range(10)]
            got = c.get([key(name) for name in names])
            assert sum(g is not None for g in got) == on_disk
            assert all(g == payload(name, 10_000) for name, g in zip(names, got, strict=True) if g is not None)
            assert c.stats().checksum_failures == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not list(tmp_path.glob("kvserve-*"))


def test_cli_rejects_bad_configuration(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--disk-capacity", "1GiB"]) == 2
    assert "--disk-path" in capsys.readouterr().err


def test_bench_store_runs_and_reports_ratios() -> None:
    result = bench.run(total=2 << 20, block=256 << 10, batch=4, repeat=1)
    assert result.blocks == 8 and result.memcpy_gbps > 0
    assert set(result.gbps) == set(bench.ROWS)
    assert "x memcpy" in bench.report(result)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "unreadable meta"])
def test_a_damaged_disk_tier_is_moved_aside_and_the_store_serves(tmp_path: Path, damage: str) -> None:
    # Truncated under LMDB's own map, it used to kill the store with SIGBUS at start; garbled, with a
    # traceback. It only held cache: the store moves it aside, says why, and starts with an empty one.
    blocks = [(key(i), payload(i, 10_000)) for i in range(20)]
    proc, port = start_process(args(tmp_path))
    with KVStoreClient(f"127.0.0.1:{port}") as c:
        c.put(blocks)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    data = tmp_path / "db" / "data.mdb"
    if damage == "truncated":
        os.truncate(data, data.stat().st_size // 3)
    elif damage == "garbage":
        data.write_bytes(os.urandom(data.stat().st_size))
    else:
        with data.open("r+b") as f:
            f.write(b"\0" * 8192)  # both meta pages
    proc, port = start_process(args(tmp_path))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.stats().tier("disk").blocks == 0
            assert c.put(blocks) == 20 and c.get([k for k, _ in blocks]) == [p for _, p in blocks]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    [aside] = list(tmp_path.glob("db.quarantined-*"))
    assert (aside / "data.mdb").exists()


def test_an_unusable_disk_path_leaves_the_memory_tiers_serving(tmp_path: Path) -> None:
    proc, port = start_process(["--host-capacity", "1MiB", "--disk-capacity", "16MiB",
                                "--disk-path", "/proc/kvserve-no-such-dir/db", "--shm-root", str(tmp_path)])
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert [t.tier for t in c.stats().tiers] == ["host"]
            assert c.put([(key(1), payload(1, 1000))]) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
