"""`python -m kvstore` as a real process: SIGTERM flushes memory to disk, SIGKILL never corrupts it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvserve.bench import store_transfer as bench
from kvstore import KVStoreClient
from kvstore.__main__ import main
from tests.kvstore_fixtures import key, payload, start_process
from tests.polling import wait_until


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


def test_a_lease_lapses_on_its_ttl_while_the_store_is_idle(tmp_path: Path) -> None:
    """A lease's pin ends on its TTL with no call to end it (the sweeper, and Stats itself, expire it)."""
    proc, port = start_process(args(tmp_path))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.put([(key(1), payload(1, 1000))]) == 1
            assert c.lookup([key(1)], lease_ttl_s=0.5).lease_id
            time.sleep(1.5)
            stats = c.stats()
            assert (stats.leases, stats.pinned_blocks) == (0, 0)
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
    assert main(["--insecure", "--disk-capacity", "1GiB"]) == 2
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


def test_a_disk_that_fills_up_at_runtime_leaves_the_store_serving_with_honest_stats(tmp_path: Path) -> None:
    # No file of the process may grow past 2 MiB (RLIMIT_FSIZE, as a disk that fills up): LMDB's writes
    # fail once its data file reaches that, with 5 MB of blocks going down to disk. (No shared-memory
    # arena: its segment is a file too.)
    log = (tmp_path / "kvstore.log").open("w")
    proc, port = start_process(["--host-capacity", "256KiB", "--disk-capacity", "64MiB", "--disk-path",
                                str(tmp_path / "db"), "--no-shm"], max_file_bytes=2 << 20, stderr=log)
    names = list(range(100))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            for i in names:
                assert c.put([(key(i), payload(i, 50_000))]) == 1  # every put succeeds, disk or not
            wait_until(lambda: not c.stats().tier("disk").available, timeout_s=15,
                       message="the disk tier stayed available")
            wait_until(lambda: c.stats().disk_write_failures > 0, timeout_s=15, message="no failed disk write counted")
            time.sleep(0.5)  # the writes already queued fail, and the store forgets their blocks
            stats = c.stats()
            on_disk = [i for i in names if c.lookup([key(i)]).tiers == ["disk"]]
            assert stats.tier("disk").blocks == len(on_disk) > 0  # only what LMDB holds is counted
            assert len(on_disk) + stats.disk_write_failures + stats.tier("host").blocks <= len(names)
            for i in on_disk:  # what it holds is still read
                assert c.get([key(i)]) == [payload(i, 50_000)]
            assert c.put([(key("after"), payload("after", 50_000))]) == 1  # the memory tier takes the rest
            assert c.get([key("after")]) == [payload("after", 50_000)]
            assert c.stats().tier("host").available
            assert c.stats().checksum_failures == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log.close()
    text = (tmp_path / "kvstore.log").read_text()
    assert text.count("stopped taking blocks") == 1, text  # one line, not one a block
    assert "durable=False" in text and "dropped" in text, text


@pytest.fixture()
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem (tmpfs), where this machine lets the tests mount one (root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_real_filesystem_that_fills_up_leaves_the_store_serving_with_honest_stats(small_filesystem: Path) -> None:
    """The same as above on a real full filesystem (ENOSPC), not a file-size limit."""
    log = (small_filesystem.parent / "kvstore.log").open("w")
    proc, port = start_process(["--host-capacity", "256KiB", "--disk-capacity", "64MiB", "--disk-path",
                                str(small_filesystem / "db"), "--no-shm"], stderr=log)
    names = list(range(100))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            for i in names:
                assert c.put([(key(i), payload(i, 50_000))]) == 1
            wait_until(lambda: not c.stats().tier("disk").available, timeout_s=15,
                       message="the disk tier stayed available")
            time.sleep(0.5)
            stats = c.stats()
            on_disk = [i for i in names if c.lookup([key(i)]).tiers == ["disk"]]
            assert stats.tier("disk").blocks == len(on_disk) > 0 and stats.disk_write_failures > 0
            for i in on_disk:
                assert c.get([key(i)]) == [payload(i, 50_000)]
            assert c.put([(key("after"), payload("after", 50_000))]) == 1
            assert c.get([key("after")]) == [payload("after", 50_000)]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log.close()
    text = (small_filesystem.parent / "kvstore.log").read_text()
    assert text.count("stopped taking blocks") == 1 and "durable=False" in text, text


def test_a_data_file_truncated_under_a_running_store_kills_nothing(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 10_000)) for i in range(20)]  # most go down to disk
    data = tmp_path / "db" / "data.mdb"
    proc, port = start_process(args(tmp_path))
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.put(blocks) == 20
            on_disk = c.stats().tier("disk").blocks
            assert on_disk > 0
            wait_until(lambda: data.stat().st_size > on_disk * 10_000, timeout_s=15,  # committed
                       message="the blocks were never committed to disk")
            time.sleep(0.3)  # and the writer idle
            os.truncate(data, data.stat().st_size // 3)
            got = c.get([k for k, _ in blocks])  # LMDB's map past the file's end: SIGBUS, unless checked
            assert proc.poll() is None
            assert all(g is None or g == p for g, (_, p) in zip(got, blocks, strict=True))
            assert sum(g is None for g in got) >= on_disk
            wait_until(lambda: c.stats().tier("disk").blocks == 0, timeout_s=15,
                       message="blocks left on the disk tier")
            assert not c.stats().tier("disk").available
            assert c.put([(key("after"), payload("after", 10_000))]) == 1
            assert c.get([key("after")]) == [payload("after", 10_000)]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    proc, port = start_process(args(tmp_path))  # the damaged tier is moved aside at start
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.stats().tier("disk").available and c.put(blocks) == 20
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(list(tmp_path.glob("db.quarantined-*"))) == 1


def test_a_hung_store_costs_a_same_host_call_one_timeout(tmp_path: Path) -> None:
    """A store stopped (SIGSTOP) does not answer on its arena's channel: a Lookup, Get or Put fails with
    DEADLINE_EXCEEDED after the client's timeout, once (not again by gRPC, which would wait as long), and
    works again once the store runs. So do calls made at once from several threads of one client, whether
    its channel is open (they wait for it together, not each in turn) or still to be opened (one asks Info)."""
    proc, port = start_process(args(tmp_path))
    stat = Path(f"/proc/{proc.pid}/stat")
    clients = [KVStoreClient(f"127.0.0.1:{port}", timeout_s=1.0) for _ in range(4)]

    def stop() -> None:
        proc.send_signal(signal.SIGSTOP)  # it lands a moment after kill() returns
        wait_until(lambda: stat.read_text().rpartition(")")[2].split()[0] == "T", timeout_s=10)

    def timed_out(call: Callable[[KVStoreClient], object], c: KVStoreClient) -> float:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call(c)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        return time.monotonic() - start

    try:
        assert clients[0].put([(key(1), payload(1, 1000))]) == 1
        for c in clients[:3]:
            assert c.lookup([key(1)]).num_hits == 1 and c.open_arena is not None  # each on the arena's channel
        calls = (lambda c: c.lookup([key(1)], lease_ttl_s=5), lambda c: c.get([key(1)]),
                 lambda c: c.put([(key(2), payload(2, 1000))]))
        stop()
        try:
            for c, call in zip(clients[:3], calls, strict=True):
                assert timed_out(call, c) < 1.8  # one timeout of 1 s, not two
        finally:
            proc.send_signal(signal.SIGCONT)
        for c in clients[:3]:
            assert c.get([key(1)]) == [payload(1, 1000)]
            assert c.open_arena is not None  # the channel opened again
        stop()
        try:
            for c in (clients[0], clients[3]):  # its channel open; never opened
                with ThreadPoolExecutor(4) as pool:
                    took = list(pool.map(timed_out, [calls[0]] * 4, [c] * 4))
                assert max(took) < 1.8, took
        finally:
            proc.send_signal(signal.SIGCONT)
        assert clients[3].lookup([key(1)]).num_hits == 1
    finally:
        for c in clients:
            c.close()
        proc.terminate()
        proc.wait(timeout=30)
