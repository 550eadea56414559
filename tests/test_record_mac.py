"""Every store record is bound to the block hash it is stored under (kvstore/block_format.py): with a record
key sealed (AES-GCM, its header under HMAC-SHA256), without one by its checksum. The attacks of someone who can write Redis or the LMDB files,
played against a real redis-server and real LMDB: a record moved between the blocks of a prompt, a forged record
(valid layout, zero payload, right checksum), a record from another deployment (another record key). With a key
each is a counted miss; without one a moved record is still a miss, and a forged one is served: the documented
limit of plaintext mode."""

from __future__ import annotations

import argparse
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest

from kvstore import KVStoreClient
from kvstore.__main__ import load_record_key, parser
from kvstore.block_format import checksum, pack_record
from kvstore.config import RemoteConfig
from kvstore.disk_tier import HEADERS_DB
from kvstore.record_key import MIN_HEX_CHARS, RecordKey, load, write_new
from kvstore.remote_tier import RemoteTier
from kvstore.store import BlockStore
from tests.kvstore_fixtures import REPO, key, make_store, payload, running_server
from tests.redis_fixtures import RedisServer, needs_redis
from tests.test_remote_tier import RELAXED_S, put_and_write, remote

KEY = RecordKey(b"0123456789abcdef" * 4)
OTHER = RecordKey(b"fedcba9876543210" * 4)  # another deployment's
BLOCK = 4096
ZEROS = bytes(BLOCK)
PROMPT = 4  # blocks; the attacks change the record under block 2 (and "moved" the one under block 1 too)

# record key, attack, then what a reader finds: leading hits and MAC failures; None where the record is a miss
CASES = [
    (KEY, "moved", 1, 2),
    (KEY, "forged", 2, 1),
    (KEY, "other deployment", 2, 1),
    (None, "moved", 1, 2),
    (None, "forged", PROMPT, 0),  # accepted: whoever can write forges records without a key
    (None, "other deployment", 2, 1),
]
IDS = [f"{'mac' if k else 'plaintext'}-{attack.replace(' ', '-')}" for k, attack, *_ in CASES]


def attacked(attack: str, keys: list[bytes], read: Callable[[bytes], bytes]) -> dict[bytes, bytes]:
    """The values the attacker writes, by block hash: `read` gives a record as the store wrote it."""
    target = keys[2]
    if attack == "moved":  # the records of blocks 1 and 2 trade places
        return {keys[1]: read(keys[2]), keys[2]: read(keys[1])}
    if attack == "forged":  # what anyone can compute without the record key
        return {target: pack_record(target, ZEROS, checksum(ZEROS), None)}
    return {target: pack_record(target, payload(2, BLOCK), checksum(payload(2, BLOCK)), OTHER)}


def check_reads(store: BlockStore, keys: list[bytes], hits: int) -> None:
    reads = [r.payload if r else None for r in store.get(keys)]
    if hits == PROMPT:  # the forged block, served
        assert reads == [payload(0, BLOCK), payload(1, BLOCK), ZEROS, payload(3, BLOCK)]
    else:
        assert reads[:hits] == [payload(i, BLOCK) for i in range(hits)] and reads[2] is None
    store.check_integrity()


# -- Redis -------------------------------------------------------------------------------------


@pytest.fixture
def stores(redis_server: RedisServer) -> Iterator[Callable[[RecordKey | None], BlockStore]]:
    """Makes stores over `redis_server` under a record key (or none); closes them."""
    made: list[BlockStore] = []

    def make(record_key: RecordKey | None) -> BlockStore:
        tier = RemoteTier(RemoteConfig(redis_server.url, timeout_s=RELAXED_S), record_key=record_key)
        made.append(make_store(host=100_000, remote=tier))
        return made[-1]

    yield make
    for store in made:
        store.close()


@needs_redis
@pytest.mark.parametrize(("record_key", "attack", "hits", "mac_failures"), CASES, ids=IDS)
def test_a_redis_record_not_written_under_its_key_is_a_counted_miss(
        redis_server: RedisServer, stores: Callable[[RecordKey | None], BlockStore], record_key: RecordKey | None,
        attack: str, hits: int, mac_failures: int) -> None:
    writer, reader = stores(record_key), stores(record_key)
    keys = [key(i) for i in range(PROMPT)]
    for i, k in enumerate(keys):
        assert writer.put(k, payload(i, BLOCK))
    assert remote(writer).flush(10)
    client = redis_server.client()
    assert client.exists(*(remote(writer).key(k) for k in keys)) == PROMPT
    for k, value in attacked(attack, keys, lambda k: client.get(remote(writer).key(k)) or b"").items():
        client.set(remote(writer).key(k), value)

    assert reader.lookup(keys).num_hits == hits
    stats = remote(reader).stats()
    assert (stats.hits, stats.mac_failures, stats.checksum_failures) == (hits, mac_failures, 0)
    check_reads(reader, keys, hits)


@needs_redis
def test_the_same_record_key_reads_what_it_wrote(stores: Callable[[RecordKey | None], BlockStore]) -> None:
    """The control of the cases above: untouched records are hits across stores sharing a key, and misses for a
    store under another key or none."""
    keys = put_and_write(stores(KEY), range(3))
    same, other, none = (stores(k) for k in (RecordKey(b"0123456789abcdef" * 4), OTHER, None))
    assert [s.lookup(keys).num_hits for s in (same, other, none)] == [3, 0, 0]
    assert [remote(s).stats().mac_failures for s in (same, other, none)] == [0, 3, 3]


# -- LMDB --------------------------------------------------------------------------------------


def disk_store(tmp_path: Path, record_key: RecordKey | None) -> BlockStore:
    return make_store(host=0, disk=100_000, tmp=tmp_path, record_key=record_key)


def edit_lmdb(path: Path, edit: Callable[[Callable[[bytes], bytes]], dict[bytes, bytes]]) -> None:
    """Writes the values `edit` returns (given a reader of the stored ones) into the LMDB at `path`."""
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        for k, value in edit(lambda k: bytes(txn.get(k) or b"")).items():
            txn.put(k, value)
    env.close()


@pytest.mark.parametrize(("record_key", "attack", "hits", "mac_failures"), CASES, ids=IDS)
def test_an_lmdb_record_not_written_under_its_key_is_a_counted_miss_after_a_restart(
        tmp_path: Path, record_key: RecordKey | None, attack: str, hits: int, mac_failures: int) -> None:
    """The disk tier is indexed from its headers database at start, so a record changed behind it is found by
    the read that opens it, as one changed while the store runs."""
    store = disk_store(tmp_path, record_key)
    keys = [key(i) for i in range(PROMPT)]
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    store.close()
    edit_lmdb(tmp_path / "lmdb", lambda read: attacked(attack, keys, read))

    again = disk_store(tmp_path, record_key)
    try:
        check_reads(again, keys, hits)
        assert again.stats().mac_failures == mac_failures and again.stats().checksum_failures == 0
        assert len(again) == PROMPT - mac_failures and again.lookup(keys).num_hits == hits
    finally:
        again.close()


def test_a_header_not_written_under_its_key_is_dropped_when_the_disk_tier_is_indexed(tmp_path: Path) -> None:
    store = disk_store(tmp_path, KEY)
    keys = [key(i) for i in range(PROMPT)]
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=1)
    headers = env.open_db(HEADERS_DB)
    with env.begin(write=True) as txn:  # the headers of blocks 1 and 2 trade places
        one, two = bytes(txn.get(keys[1], db=headers)), bytes(txn.get(keys[2], db=headers))
        txn.put(keys[1], two, db=headers)
        txn.put(keys[2], one, db=headers)
    env.close()
    again = disk_store(tmp_path, KEY)
    try:
        assert again.stats().mac_failures == 2 and len(again) == PROMPT - 2
        check_reads(again, keys, 1)
    finally:
        again.close()


def test_an_lmdb_record_moved_under_a_running_store_is_a_counted_miss(tmp_path: Path) -> None:
    """Another process moves a record while the store serves: the read finds it, over gRPC."""
    config = dict(host_capacity=0, disk_capacity=100_000, disk_path=tmp_path / "db", record_key=KEY)
    with running_server(tmp_path, **config) as server, KVStoreClient(server.address) as c:
        c.put([(key(i), payload(i, BLOCK)) for i in range(3)])
        assert server.store.flush_to_disk(10).durable
        mover = ("import lmdb, sys; env = lmdb.open(sys.argv[1]); txn = env.begin(write=True); "
                 "txn.put(bytes.fromhex(sys.argv[3]), txn.get(bytes.fromhex(sys.argv[2]))); txn.commit()")
        subprocess.run([sys.executable, "-c", mover, str(tmp_path / "db"), key(0).hex(), key(1).hex()], check=True,
                       timeout=60)
        assert c.get([key(i) for i in range(3)]) == [payload(0, BLOCK), None, payload(2, BLOCK)]
        stats = c.stats()
        assert (stats.mac_failures, stats.checksum_failures) == (1, 0)
        assert c.lookup([key(1)]).num_hits == 0


def test_records_of_the_old_layout_are_misses_after_the_upgrade(tmp_path: Path) -> None:
    store = disk_store(tmp_path, KEY)
    store.put(key(0), payload(0, BLOCK))
    store.close()
    old = struct.Struct("<4sIQQQ")  # layout 1: magic, flags, checksum, size, seq
    clear = struct.Struct("<4sHHQQQ32s32s")  # layout 2, in the clear: ..., a BLAKE3 digest and an HMAC tag

    def old_layouts(read: Callable[[bytes], bytes]) -> dict[bytes, bytes]:
        records = {key(i): old.pack(b"KVSR", flags, checksum(payload(i, BLOCK)), BLOCK, 5) + payload(i, BLOCK)
                   for i, flags in ((1, 0), (2, 1))}  # flags: 1 is an ephemeral block
        records[key(3)] = clear.pack(b"KVSR", 2, 0, checksum(payload(3, BLOCK)), BLOCK, 6, bytes(32),
                                     bytes(32)) + payload(3, BLOCK)
        return records

    edit_lmdb(tmp_path / "lmdb", old_layouts)
    again = disk_store(tmp_path, KEY)
    try:
        assert len(again) == 1 and again.lookup([key(0), key(1)]).num_hits == 1
        assert [r.payload if r else None for r in again.get([key(1), key(2), key(3)])] == [None, None, None]
        stats = again.stats()
        assert (stats.mac_failures, stats.checksum_failures) == (0, 0)
        again.check_integrity()
    finally:
        again.close()
    env = lmdb.open(str(tmp_path / "lmdb"))
    with env.begin() as txn:  # deleted at start
        assert [txn.get(key(i)) is None for i in range(4)] == [False, True, True, True]
    env.close()


# -- the record key file -------------------------------------------------------------------------


def test_a_new_record_key_file_is_private_random_and_never_replaced(tmp_path: Path) -> None:
    path = write_new(tmp_path / "record-key")
    text = path.read_text().strip()
    assert len(text) == 64 and int(text, 16) >= 0 and os.stat(path).st_mode & 0o777 == 0o600
    assert write_new(tmp_path / "other").read_text() != path.read_text()
    with pytest.raises(FileExistsError):
        write_new(path)
    assert path.read_text().strip() == text
    message = b"fields and a block hash"
    assert load(path).tag(message) == load(path).tag(message) != load(tmp_path / "other").tag(message)
    assert repr(load(path)) == "RecordKey(<secret>)" and text not in repr(load(path))


@pytest.mark.parametrize(("content", "why"), [
    (None, "cannot be read"),
    ("ab" * (MIN_HEX_CHARS // 2 - 1), "at least 32 hex characters"),
    ("correct horse battery staple, a passphrase", "at least 32 hex characters"),
])
def test_a_record_key_file_that_cannot_be_used_is_refused(tmp_path: Path, content: str | None, why: str) -> None:
    path = tmp_path / "record-key"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)
    with pytest.raises(ValueError, match=why):
        load(path)


def test_a_record_key_file_others_may_read_is_used_with_a_warning(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = write_new(tmp_path / "record-key")
    path.chmod(0o640)  # the process's own group (a Kubernetes Secret under fsGroup): no warning
    with caplog.at_level(logging.WARNING, "kvstore.record_key"):
        load(path)
    assert not caplog.records
    path.chmod(0o604)
    with caplog.at_level(logging.WARNING, "kvstore.record_key"):
        load(path)
    assert any("readable by other users (mode 604)" in r.getMessage() for r in caplog.records)


def test_a_remote_tier_needs_a_record_key_unless_insecure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def args(*argv: str, insecure: bool = False) -> argparse.Namespace:
        parsed = parser().parse_args(list(argv))
        parsed.insecure = insecure
        return parsed

    remote = ("--remote-url", "redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="--remote-url needs --record-key-file"):
        load_record_key(args(*remote))
    path = write_new(tmp_path / "record-key")
    assert isinstance(load_record_key(args(*remote, "--record-key-file", str(path))), RecordKey)
    with caplog.at_level(logging.WARNING, "kvstore"):
        assert load_record_key(args(*remote, insecure=True)) is None
        assert load_record_key(args()) is None
    assert [r.getMessage().startswith("no --record-key-file: store records are bound to their keys by checksum only")
            for r in caplog.records] == [True, True]


def test_the_store_refuses_to_start_with_a_missing_record_key_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, "-m", "kvstore", "--listen", "127.0.0.1:0", "--record-key-file",
                           str(missing)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"kvstore: --record-key-file {missing}: cannot be read (No such "
                                                    "file or directory)")
