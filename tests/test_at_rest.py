"""Nothing readable at rest (issue 59): with a record key, the disk tier and Redis hold sealed records, in which
no byte of a block's KV appears; every file the store and `kvserve up` write is their user's alone, so another
local user reads nothing of them. Against real LMDB files, a real redis-server and a real `kvserve up`, read as
another uid (`nobody`) where the tests run as root."""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import lmdb
import pytest
import redis

from client.local import Layout
from kvstore.block_format import HEADER_BYTES, CorruptBlock, ForeignRecord, unpack_record
from kvstore.config import RemoteConfig
from kvstore.disk_tier import HEADERS_DB, DiskTier
from kvstore.record_key import RecordKey, load
from kvstore.remote_tier import RemoteTier
from tests.kvstore_fixtures import key, make_store, payload
from tests.processes import KVSERVE, free_ports
from tests.redis_fixtures import RedisServer, needs_redis
from tests.stack_fixtures import model_dir
from tests.test_remote_tier import RELAXED_S, put_and_write

KEY = RecordKey(b"0123456789abcdef" * 4)
BLOCK = 4096
BLOCKS = 6


def holds_kv(raw: bytes, payloads: list[bytes]) -> int:
    """How many of `payloads` show in `raw`: any 32-byte stretch of one (each repeats a 32-byte seed)."""
    return sum(p[:32] in raw for p in payloads)


@pytest.mark.parametrize("record_key", [KEY, None], ids=["sealed", "plaintext"])
def test_the_disk_tier_holds_kv_only_in_plaintext_mode(tmp_path: Path, record_key: RecordKey | None) -> None:
    store = make_store(host=0, disk=100_000, tmp=tmp_path, record_key=record_key)
    payloads = [payload(i, BLOCK) for i in range(BLOCKS)]
    for i, p in enumerate(payloads):
        store.put(key(i), p)
    store.close()
    raw = b"".join(f.read_bytes() for f in (tmp_path / "lmdb").iterdir() if f.is_file())
    assert holds_kv(raw, payloads) == (0 if record_key else BLOCKS)
    again = make_store(host=0, disk=100_000, tmp=tmp_path, record_key=record_key)
    try:  # and the store reads them back, whole
        assert [r.payload if r else None for r in again.get([key(i) for i in range(BLOCKS)])] == payloads
    finally:
        again.close()


@needs_redis
@pytest.mark.parametrize("record_key", [KEY, None], ids=["sealed", "plaintext"])
def test_redis_holds_kv_only_in_plaintext_mode(redis_server: RedisServer, record_key: RecordKey | None) -> None:
    tier = RemoteTier(RemoteConfig(redis_server.url, timeout_s=RELAXED_S), record_key=record_key)
    store = make_store(host=100_000, remote=tier)
    try:
        keys = put_and_write(store, range(BLOCKS))
        reader = redis.Redis.from_url(redis_server.url)  # whoever can read Redis: every value in it
        raw = b"".join(reader.get(name) or b"" for name in reader.keys("*"))
        reader.close()
        assert len(raw) > BLOCKS * 100 and holds_kv(raw, [payload(i) for i in range(BLOCKS)]) == (0 if record_key
                                                                                                   else BLOCKS)
        assert [f[0] if f else None for f in tier.get(keys)] == [payload(i) for i in range(BLOCKS)]
    finally:
        store.close()


def test_a_sealed_record_opens_only_under_its_block_hash_and_key(tmp_path: Path) -> None:
    store = make_store(host=0, disk=100_000, tmp=tmp_path, record_key=KEY)
    store.put(key(0), payload(0, BLOCK))
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"))
    with env.begin() as txn:
        record = bytes(txn.get(key(0)))
    env.close()
    assert unpack_record(key(0), record, KEY) == (payload(0, BLOCK), unpack_record(key(0), record, KEY)[1])
    flipped = bytearray(record)
    flipped[HEADER_BYTES + 100] ^= 1  # one bit of the ciphertext
    for attempt, under in ((flipped, KEY), (record, RecordKey(b"f" * 64))):
        with pytest.raises(ForeignRecord):
            unpack_record(key(0), attempt, under)
    with pytest.raises(ForeignRecord):  # under another block hash
        unpack_record(key(1), record, KEY)
    with pytest.raises(CorruptBlock):  # read as plaintext
        unpack_record(key(0), record, None)


def test_the_disk_tier_is_its_users_alone_even_where_an_older_one_was_not(tmp_path: Path) -> None:
    before = os.umask(0o022)  # a wide umask, as in a shell
    try:
        fresh = DiskTier(tmp_path / "fresh", 100_000, record_key=KEY)
        fresh.close()
        old = tmp_path / "old"
        DiskTier(old, 100_000, record_key=KEY).close()
        os.chmod(old, 0o755)
        for f in old.iterdir():
            os.chmod(f, 0o644)
        DiskTier(old, 100_000, record_key=KEY).close()
    finally:
        os.umask(before)
    for folder in (tmp_path / "fresh", old):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {
            "data.mdb": 0o600, "lock.mdb": 0o600, "kvstore.lock": 0o600}


def read_as(user: str, root: Path) -> tuple[int, int]:
    """(bytes read, paths refused) walking `root` and reading every file as `user`, in a process of its own."""
    walker = ("import os, sys\nread = refused = 0\n"
              "def walk(p):\n    global read, refused\n"
              "    try:\n        names = os.listdir(p)\n    except OSError:\n        refused += 1; return\n"
              "    for n in names:\n        q = os.path.join(p, n)\n"
              "        if os.path.isdir(q) and not os.path.islink(q):\n            walk(q); continue\n"
              "        try:\n            read += len(open(q, 'rb').read())\n        except OSError:\n            refused += 1\n"
              "walk(sys.argv[1])\nprint(read, refused)")
    user_ = pwd.getpwnam(user)
    out = subprocess.run(["/usr/bin/python3", "-c", walker, str(root)], user=user_.pw_uid, group=user_.pw_gid,
                         extra_groups=[], capture_output=True, text=True, timeout=60, check=True, cwd="/")
    read, refused = out.stdout.split()
    return int(read), int(refused)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="reading as another uid needs root to become it, and a Python it may run")
def test_another_local_user_reads_nothing_of_up_and_its_disk_tier_holds_no_kv() -> None:
    """A secure default `kvserve up`, its host tier small so that a prompt's blocks go to the disk tier, in a
    folder every user may enter (pytest's own are root's alone), beside a file every user may read."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        (Path(tmp) / "public").write_bytes(b"hello")
        os.chmod(Path(tmp) / "public", 0o644)
        run_up_and_read_as_another_user(Path(tmp))


def run_up_and_read_as_another_user(tmp: Path) -> None:
    data = tmp / "data"
    decode, prefill, store = free_ports(3)
    argv = [KVSERVE, "up", "--data-dir", str(data), "--model", str(model_dir("llama")), "--no-http",
            "--host-capacity", "64KiB", "--decode-port", str(decode), "--prefill-port", str(prefill),
            "--store-port", str(store)]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert up.stdout is not None
        seen = []
        for line in up.stdout:
            seen.append(line)
            if line.startswith("ready:"):
                break
        threading.Thread(target=up.stdout.read, daemon=True).start()  # keep its pipe drained
        prompt = " ".join(f"Tr0ub4dor{i}" for i in range(200))
        subprocess.run([KVSERVE, "generate", "--data-dir", str(data), "--max-tokens", "4", prompt], check=True,
                       capture_output=True, timeout=120)
        assert read_as("nobody", tmp) == (len(b"hello"), 1), "".join(seen)  # refused at the data dir itself
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
    finally:
        os.killpg(up.pid, signal.SIGTERM)  # its store moves the memory tiers to disk as it stops
        up.wait(60)
    owned_by_others = [p for p in data.rglob("*") if stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert owned_by_others == []
    # As root, or whoever copies the disk: sealed records only, which open under the record key alone.
    record_key = load(Layout(data).record_key)
    env = lmdb.open(str(data / "kvstore"), readonly=True, lock=False)
    with env.begin() as txn:
        records = [(bytes(k), bytes(v)) for k, v in txn.cursor() if k != HEADERS_DB]
    env.close()
    assert len(records) >= 5
    payloads = [unpack_record(k, v, record_key)[0] for k, v in records]
    raw = (data / "kvstore" / "data.mdb").read_bytes()
    stretches = [w for p in payloads for i in range(0, len(p) - 32, len(p) // 4) if len(set(w := p[i:i + 32])) > 8]
    assert len(stretches) >= len(payloads) and sum(w in raw for w in stretches) == 0
