"""The device tier's arena: the same slots, socket and calls as the host arena, with a tensor for a segment.

On a CPU the arena is a memfd viewed as a tensor ("cpu-tensor"), so everything but the CUDA calls runs
here: the checksum, batched slot copies, the hand-out to another process, corruption, restart. The
`gpu` tests run the same on CUDA (cudaMalloc, CUDA IPC) where a GPU is present."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVStoreClient, device_tier
from kvstore.block_format import checksum
from kvstore.device_tier import DeviceArenaTier, TensorSegment, padded, wsum64
from kvstore.types import Tier
from tests.kvstore_fixtures import key, make_store, payload, running_server, start_process

MiB = 1024 * 1024
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference_wsum64(row: bytes) -> int:
    """wsum64 in plain Python integers: each 8-byte word times the splitmix64 odd weight of its place."""
    total = 0
    for i, (word,) in enumerate(np.frombuffer(row, dtype="<u8").reshape(-1, 1)):
        z = ((i + 1) * 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        z = (z ^ (z >> 31)) | 1
        total = (total + int(word) * z) % 2**64
    return total


def test_wsum64_is_the_weighted_word_sum_and_sees_any_one_word_changed() -> None:
    rows = torch.frombuffer(bytearray(os.urandom(3 * 512)), dtype=torch.uint8).view(3, 512)
    sums = wsum64(rows)
    assert sums == [reference_wsum64(bytes(r.numpy())) for r in rows]
    for word in (0, 17, 63):
        changed = rows.clone()
        changed[0, 8 * word] ^= 1
        assert wsum64(changed)[0] != sums[0]
    swapped = rows.clone()
    swapped[0, :8], swapped[0, 8:16] = rows[0, 8:16], rows[0, :8]
    assert wsum64(swapped)[0] != sums[0]  # words are weighted by place: moving one is a change


def test_wsum64_in_chunks_is_the_same_sum() -> None:
    rows = torch.frombuffer(bytearray(os.urandom(5 * 256)), dtype=torch.uint8).view(5, 256)
    whole = wsum64(rows)
    assert len(rows) * 256 <= device_tier.CHUNK_BYTES  # one chunk
    assert wsum64(rows, chunk_bytes=512) == whole  # two rows a chunk


def test_batches_of_slots_scatter_and_gather_whole_rows() -> None:
    segment = TensorSegment(torch.zeros(64 * 64, dtype=torch.uint8))
    blocks = [(payload(i, 64), torch.full((100,), i, dtype=torch.uint8)) for i in range(3)]
    offsets = [0, 640, 1280]
    sums = segment.write_blocks(offsets, blocks)
    got = segment.read_blocks(offsets, 164, sums)
    assert [bytes(t.numpy()) for t in got] == [p + bytes([i]) * 100 for i, (p, _) in enumerate(blocks)]  # type: ignore[union-attr]
    assert padded(164) == 192 and bytes(segment.tensor[164:192].numpy()) == bytes(28)  # the row's rest is zeros
    segment.tensor[700] ^= 0xFF  # the second slot changed under its reader
    assert [t is None for t in segment.read_blocks(offsets, 164, sums)] == [False, True, False]
    with pytest.raises(ValueError):
        segment.read_blocks([32], 164, [0])  # not on a row
    with pytest.raises(ValueError):
        segment.read_blocks([64 * 64 - 64], 164, [0])  # past the end


def test_a_block_put_into_a_device_slot_gets_its_xxh3_once_its_bytes_leave(tmp_path: Path) -> None:
    store = make_store(device=300, host=300, disk=2000, tmp=tmp_path)
    device = store.shm_tier
    assert isinstance(device, DeviceArenaTier)
    rid, (offset,) = store.reserve([100])
    assert offset is not None
    wsum = device.segment.write_blocks([offset], [[payload("a")]])[0]
    assert store.put_reserved(key("a"), rid, offset, 100, wsum)
    assert device.slot(key("a")) == (offset, 100, wsum)  # the client's slot became the block
    assert store.checksum_of(key("a")) == 0  # its xxh3 is not known yet: nothing was copied off the device
    for i in "bcdefg":  # push "a" down to host, then disk
        store.put(key(i), payload(i))
    store.check_integrity()
    assert store.tier_of(key("a")) == Tier.DISK and store.checksum_of(key("a")) == checksum(payload("a"))
    (read,) = store.get([key("a")])
    assert read is not None and read.payload == payload("a") and read.checksum == checksum(payload("a"))
    store.close()


def test_a_scribbled_device_slot_is_a_miss_counted_never_data(tmp_path: Path) -> None:
    store = make_store(device=300, host=300, tmp=tmp_path)
    device = store.shm_tier
    assert isinstance(device, DeviceArenaTier)
    store.put(key("a"), payload("a"))
    offset, size, _ = device.slot(key("a"))  # type: ignore[misc]
    device.segment.tensor[offset : offset + size] = 0  # another process writes over it
    assert list(store.get([key("a")])) == [None]
    assert store.checksum_failures == 1 and key("a") not in store
    store.check_integrity()
    store.close()


def device_store(tmp: Path, device: str = "cpu") -> tuple[subprocess.Popen[str], int]:
    return start_process(["--device", device, "--device-capacity", "32MiB", "--host-capacity", "8MiB",
                          "--shm-root", str(tmp)])


def test_another_process_opens_the_device_arena_and_moves_tensors_both_ways(tmp_path: Path) -> None:
    proc, port = device_store(tmp_path)
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            assert c.tensor_device() == torch.device("cpu")
            assert Path(c.info().arena_socket).name == "device-arena.sock"
            kv = torch.randn(4, 2, 16, 2, 8)
            header = torch.zeros(64, dtype=torch.uint8)
            blocks = [(key(i), (header, kv[i])) for i in range(4)] + [(key("tail"), (header, kv[0, :, :3]))]
            assert c.put_tensors(blocks) == 5 and c.put_tensors(blocks) == 0
            assert c.put([(key("bytes"), payload("bytes", 5000))]) == 1  # bytes into the same arena
            got = c.get_tensors([key(0), key(3), key("tail"), key("absent"), key("bytes")])
            assert got[3] is None and bytes(got[4].numpy()) == payload("bytes", 5000)  # type: ignore[union-attr]
            for t, want in zip(got[:3], [kv[0], kv[3], kv[0, :, :3]], strict=True):
                assert t is not None and torch.equal(t[64:].view(torch.float32).view(want.shape), want)
            assert c.get([key(1)]) == [bytes(64) + kv[1].numpy().tobytes()]  # and as bytes
            stats = c.stats()
            assert stats.tier("device").blocks == 6 and stats.checksum_failures == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not list(tmp_path.glob("kvserve-*"))  # its socket dir went with it


@pytest.mark.slow
def test_a_client_of_a_restarted_store_opens_its_new_arena(tmp_path: Path) -> None:
    proc, port = device_store(tmp_path)
    with KVStoreClient(f"127.0.0.1:{port}") as c:
        c.put_tensors([(key(1), (torch.ones(256, dtype=torch.uint8),))])
        proc.kill()
        proc.wait()
        proc, port2 = device_store(tmp_path)
        try:
            with KVStoreClient(f"127.0.0.1:{port2}") as c2:
                assert c2.get_tensors([key(1)]) == [None]  # memory tiers start empty
                c2.put_tensors([(key(2), (torch.full((256,), 2, dtype=torch.uint8),))])
                (got,) = c2.get_tensors([key(2)])
                assert got is not None and bool((got == 2).all())
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_client_whose_arena_closed_under_it_goes_on_with_bytes(tmp_path: Path) -> None:
    with running_server(tmp_path, device="cpu", device_capacity=32 * MiB) as server, \
            KVStoreClient(server.address) as c:
        c.put_tensors([(key(1), (torch.ones(256, dtype=torch.uint8),))])
        arena = c.open_arena
        assert arena is not None
        arena.segment.close()
        arena.segment.close()  # twice: once counts
        (got,) = c.get_tensors([key(1)])
        assert got is not None and bool((got == 1).all())  # by bytes over gRPC
        assert c.open_arena is None and c.tensor_device() is not None  # dropped, then opened again
        (got,) = c.get_tensors([key(1)])
        assert got is not None and bool((got == 1).all())
        arena.close()
        arena.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_arena_moves_blocks_device_to_device_across_processes(tmp_path: Path) -> None:
    proc, port = device_store(tmp_path, "cuda")
    try:
        with KVStoreClient(f"127.0.0.1:{port}") as c:
            device = c.tensor_device()
            assert device is not None and device.type == "cuda"
            kv = torch.randn(64, 8, 2, 16, 4, 64, dtype=torch.bfloat16, device=device)
            header = torch.zeros(64, dtype=torch.uint8)
            assert c.put_tensors([(key(i), (header, kv[i])) for i in range(64)]) == 64
            got = c.get_tensors([key(i) for i in range(64)])
            for i, t in enumerate(got):
                assert t is not None and t.device == device
                assert torch.equal(t[64:].view(torch.bfloat16).view(kv[i].shape), kv[i])
            assert c.get([key(5)]) == [bytes(64) + kv[5].view(torch.uint8).cpu().numpy().tobytes()]
            # 32 MiB of device tier holds all 64 blocks of 128 KiB
            # and back, and read the same
            stats = c.stats()
            assert stats.tier("device").blocks + stats.tier("host").blocks == 64 and stats.checksum_failures == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
