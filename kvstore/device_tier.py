"""The device tier: an arena of fixed-size slots in one buffer of GPU memory, which same-node clients
open through CUDA IPC and copy blocks into and out of device to device (docs/DESIGN.md, "Transfer").

It is the host arena's design (kvstore/arena.py) with a tensor for a segment: the same slab allocator,
the same socket (the handle goes in its greeting) and the same calls. Only three things differ, all
here: how the buffer is made and opened (cupy's cudaMalloc and CUDA IPC handles; on a CPU, a memfd
mapped as a tensor, so that everything else is tested without a GPU), the checksum (`wsum64`, which
runs on the device and gives the same number on a CPU), and how blocks are copied (one gather or
scatter kernel for a whole batch of blocks, rather than a copy per block).

Demotion to host and promotion back go through a pinned staging buffer, with asynchronous copies on a
side stream of the store's own.

The only module of kvstore that imports torch (and cupy, on CUDA).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.arena import Arena, ArenaSocket, scatter
from kvstore.slab import SLOT_ALIGN, slot_bytes
from kvstore.tier import ArenaTier
from kvstore.types import Buffer, Part, Tier
from protos.block_hash import BlockHash

log = logging.getLogger(__name__)

Tensor = torch.Tensor  # for the annotations of modules that import no torch (the client, the services' session)
Device = torch.device

_WORD = 8  # wsum64 sums 8-byte words
_ROW = SLOT_ALIGN  # slots start and end on 64-byte rows: a batch of slots is one index of rows
CHUNK_BYTES = 16 << 20  # wsum64 takes its products this many bytes of rows at a time


# -- the checksum ------------------------------------------------------------------------------

_weights: dict[torch.device, torch.Tensor] = {}
_weights_lock = threading.Lock()


def _splitmix64(n: int) -> np.ndarray:
    """n odd 64-bit weights, the same on every machine and torch version (numpy's wrapping uint64)."""
    with np.errstate(over="ignore"):
        z = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


def _weights_for(words: int, device: torch.device) -> torch.Tensor:
    with _weights_lock:
        w = _weights.get(device)
        if w is None or len(w) < words:
            n = max(words, 2 * len(w) if w is not None else 1 << 15)
            w = _weights[device] = torch.from_numpy(_splitmix64(n)).to(device)
        return w[:words]


def wsum64(rows: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The checksum of each row of `rows` ([blocks, bytes] uint8, bytes a multiple of 8): the sum of its
    8-byte words, each times its own odd weight, modulo 2**64. Integer sums wrap the same in any order,
    so a GPU and a CPU give the same number. Changing one word always changes it; any other change
    does but with a chance of 2**-64. A guard against slots reused or overwritten, not an attacker (the
    arena is open to the store's own user only). One device sync for the whole batch; the products are
    taken `chunk_bytes` of rows at a time (the sum does not depend on it)."""
    words = rows.view(torch.int64)  # [blocks, words]
    if not len(words):
        return []
    weights = _weights_for(words.shape[1], rows.device)
    step = max(1, chunk_bytes // rows.shape[1])  # bounded scratch for the products, and rows still in cache
    sums = torch.cat([(words[i : i + step] * weights).sum(dim=1) for i in range(0, len(words), step)])
    return [s & 0xFFFFFFFFFFFFFFFF for s in sums.tolist()]


def padded(size: int) -> int:
    """Bytes a block of `size` spans in its slot (what wsum64 covers): whole rows."""
    return slot_bytes(size)


# -- the segment: a uint8 tensor over the arena's memory ---------------------------------------


class TensorSegment:
    """Copies batches of blocks between a uint8 tensor over an arena's memory and tensors of the caller
    (the store's side, and a client's). A block lies at the start of its slot, and is copied with the rest
    of the slot's last row (zeros when written here), so every copy is whole rows."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # [size] uint8
        self.size = tensor.numel()
        self.device = tensor.device
        self._rows = tensor.view(torch.int64).view(-1, _ROW // _WORD)  # [size / 64, 8]: copies move 8-byte words

    def _row_index(self, offsets: Sequence[int], span: int) -> torch.Tensor:
        starts = torch.tensor([o // _ROW for o in offsets], dtype=torch.long)
        index = (starts[:, None] + torch.arange(span // _ROW)[None, :]).reshape(-1)
        return index.to(self.device, non_blocking=True)

    def gather(self, offsets: Sequence[int], size: int) -> torch.Tensor:
        """[len(offsets), padded(size)]: a copy of the slots at `offsets`, all for blocks of `size` bytes."""
        span = padded(size)
        if any(o % _ROW or o < 0 or o + span > self.size for o in offsets):
            raise ValueError("a slot lies outside the arena or off its 64-byte rows")
        rows = self._rows.index_select(0, self._row_index(offsets, span))
        return rows.view(len(offsets), span // _WORD).view(torch.uint8)

    def scatter(self, offsets: Sequence[int], rows: torch.Tensor) -> None:
        """Writes `rows` ([blocks, padded bytes], on this segment's device) into the slots at `offsets`."""
        span = rows.shape[1]
        if span % _ROW or any(o % _ROW or o < 0 or o + span > self.size for o in offsets):
            raise ValueError("a slot lies outside the arena or off its 64-byte rows")
        self._rows.index_copy_(0, self._row_index(offsets, span), rows.contiguous().view(torch.int64).view(-1, _ROW // _WORD))

    def read_blocks(self, offsets: Sequence[int], size: int, checksums: Sequence[int]) -> list[torch.Tensor | None]:
        """Copies of `size`-byte blocks (each a [size] view of one batch) whose slots match their checksums;
        None for a slot whose bytes changed (reused, overwritten)."""
        if not offsets:
            return []
        rows = self.gather(offsets, size)
        return [row[:size] if got == want else None
                for row, got, want in zip(rows, wsum64(rows), checksums, strict=True)]

    def write_blocks(self, offsets: Sequence[int], blocks: Sequence[Sequence[torch.Tensor | Buffer]]) -> list[int]:
        """Writes blocks of one size (each given in parts: bytes or uint8-viewable tensors, one after
        another) into the slots at `offsets`; returns their checksums, taken on the rows as written.
        Blocks in parts of the same sizes (a header, a KV slot) are copied a column of parts at a time."""
        if not offsets:
            return []
        sizes = [[_nbytes(p) for p in parts] for parts in blocks]
        size = sum(sizes[0])
        if any(sum(s) != size for s in sizes):
            raise ValueError("blocks written together must be of one size")
        rows = torch.empty(len(blocks), padded(size), dtype=torch.uint8, device=self.device)
        rows[:, size:].zero_()  # the last row's rest: the checksum covers it
        if all(s == sizes[0] for s in sizes):
            at = 0
            for j, n in enumerate(sizes[0]):
                rows[:, at : at + n].copy_(_stacked([parts[j] for parts in blocks], self.device), non_blocking=True)
                at += n
        else:
            for row, parts in zip(rows, blocks, strict=True):
                at = 0
                for part in parts:
                    n = _nbytes(part)
                    row[at : at + n].copy_(as_uint8(part), non_blocking=True)
                    at += n
        sums = wsum64(rows)
        self.scatter(offsets, rows)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # in the arena before the store is told
        return sums

    def write_many(self, offsets: Sequence[int], blocks: Sequence[Sequence[torch.Tensor | Buffer]]) -> list[int]:
        """write_blocks for blocks of any sizes: one batch per size."""
        by_size: dict[int, list[int]] = {}
        for i, parts in enumerate(blocks):
            by_size.setdefault(sum(_nbytes(p) for p in parts), []).append(i)
        sums = [0] * len(blocks)
        for batch in by_size.values():
            written = self.write_blocks([offsets[i] for i in batch], [blocks[i] for i in batch])
            for i, csum in zip(batch, written, strict=True):
                sums[i] = csum
        return sums


def _stacked(parts: Sequence[torch.Tensor | Buffer], device: torch.device) -> torch.Tensor:
    """[len(parts), bytes] of equal-size parts: stacked where they are, so that host bytes cross to the
    device in one copy and device tensors never leave it."""
    flat = [as_uint8(p) for p in parts]
    if any(t.device != flat[0].device for t in flat):
        flat = [t.to(device) for t in flat]
    return torch.stack(flat)


def as_uint8(part: torch.Tensor | Buffer) -> torch.Tensor:
    """A flat uint8 view of a tensor, or a tensor over bytes (not copied)."""
    if isinstance(part, torch.Tensor):
        return part.reshape(-1).view(torch.uint8)
    with contextlib.suppress(TypeError):
        part = memoryview(part).cast("B")
    return torch.frombuffer(bytearray(part) if memoryview(part).readonly else part, dtype=torch.uint8)


def host_tensor(payload: Buffer) -> torch.Tensor:
    """A flat uint8 tensor holding a copy of `payload`."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _nbytes(part: torch.Tensor | Buffer) -> int:
    return part.numel() * part.element_size() if isinstance(part, torch.Tensor) else memoryview(part).nbytes


# -- the store's side: where the buffer lives and how another process opens it ------------------


class DeviceArena:
    """The device tier's buffer. On CUDA: one cudaMalloc (plain device memory, never managed), shared
    by its CUDA IPC handle; on a CPU: a sealed memfd (the host arena's), mapped as a tensor."""

    def __init__(self, capacity: int, device: str) -> None:
        self.device = torch.device(device)
        self.memfd: Arena | None = None
        self._ptr = 0
        if self.device.type == "cuda":
            cupy = _cupy()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.size = -(-capacity // (4 << 20)) * (4 << 20)
            self._index = index
            with cupy.cuda.Device(index):
                self._ptr = cupy.cuda.runtime.malloc(self.size)
                try:
                    self.handle: bytes | None = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
                except cupy.cuda.runtime.CUDARuntimeError as exc:
                    log.warning("the device arena cannot be shared by CUDA IPC (%s): same-node clients will send "
                                "and receive its blocks as bytes", exc)
                    self.handle = None
            self.tensor = _cuda_tensor(self._ptr, self.size, index)
            self.uuid = str(torch.cuda.get_device_properties(index).uuid)
        else:
            self.memfd = Arena(capacity, name="kvserve-device-arena")
            self.size = self.memfd.size
            self.tensor = torch.frombuffer(self.memfd.view, dtype=torch.uint8)

    def export(self) -> tuple[dict[str, Any], list[int]]:
        """How a same-node client opens the buffer: the greeting's fields and the fds it carries."""
        if self.memfd is not None:
            return {"kind": "cpu-tensor", "size": self.size}, [self.memfd.fd]
        if self.handle is None:
            return {"kind": "cuda-unshared", "size": self.size}, []
        return {"kind": "cuda-ipc", "size": self.size, "handle": self.handle.hex(), "device": self.uuid}, []

    def close(self) -> None:
        if self.memfd is not None:
            del self.tensor
            self.memfd.close()
        elif self._ptr:
            import cupy

            del self.tensor
            torch.cuda.synchronize(self.device)
            with cupy.cuda.Device(self._index):
                cupy.cuda.runtime.free(self._ptr)
            self._ptr = 0


def _cupy() -> Any:
    try:
        import cupy  # the `gpu` extra
    except ImportError as exc:
        raise ValueError("a device arena on CUDA needs cupy: pip install 'kvserve[gpu]' (CUDA 12) or "
                         "'kvserve[gpu-cuda13]'") from exc
    return cupy


def _cuda_tensor(ptr: int, size: int, device_index: int, owner: object = None) -> torch.Tensor:
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, size, owner, device_index)
    array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=torch.device("cuda", device_index))


class OpenedSegment(TensorSegment):
    """A client's opening of a store's device arena (from the socket's greeting): batches of blocks as
    tensors (`read_many`, `write_many`), and the host arena's calls on bytes, one block at a time.

    CUDA opens an IPC handle once per process: every client of the same arena in a process shares one
    opening (`open_device_segment`), which is unmapped when the last of them closes it and no copy is
    running; a call after that is an OSError (its client goes on with bytes)."""

    def __init__(self, greeting: dict[str, Any], fds: list[int]) -> None:
        self._map: Any = None
        self._ptr = 0
        self._lock = threading.Lock()
        self._holders = 1  # clients that opened it
        self._users = 0  # copies running
        self.closed = False
        kind, size = greeting.get("kind"), int(greeting.get("size", 0))
        if kind == "cpu-tensor":
            import mmap

            if len(fds) != 1:
                raise OSError("a cpu-tensor arena comes with one fd")
            self._map = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        elif kind == "cuda-ipc":
            tensor = self._open_ipc(greeting, size)
        else:
            raise OSError(f"an arena of kind {kind!r} is not one this client opens")
        super().__init__(tensor)

    def _open_ipc(self, greeting: dict[str, Any], size: int) -> torch.Tensor:
        index = _device_with_uuid(str(greeting.get("device", "")))
        if index is None:
            raise OSError(f"the store's GPU {greeting.get('device')} is not visible to this process")
        try:
            cupy = _cupy()
        except ValueError as exc:
            raise OSError(str(exc)) from exc
        self._index = index
        try:
            with cupy.cuda.Device(index):
                self._ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                    bytes.fromhex(str(greeting["handle"])), cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            return _cuda_tensor(self._ptr, size, index, self)
        except (cupy.cuda.runtime.CUDARuntimeError, ValueError, KeyError, RuntimeError) as exc:
            self._unmap()
            raise OSError(f"cannot open the store's device arena by CUDA IPC: {exc}") from exc

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        with self._lock:
            if self.closed:
                raise OSError("the store's device arena was closed")
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                last = self.closed and not self._users
            if last:
                self._unmap()

    def read(self, offset: int, size: int, checksum: int) -> bytes | None:
        got = self.read_many([offset], [size], [checksum])[0]
        return None if got is None else got.cpu().numpy().tobytes()

    def read_into(self, offset: int, size: int, checksum: int, out: Sequence[Part]) -> bool:
        payload = self.read(offset, size, checksum)
        return payload is not None and scatter(payload, out)

    def read_many(self, offsets: Sequence[int], sizes: Sequence[int], checksums: Sequence[int]
                  ) -> list[torch.Tensor | None]:
        """read_blocks for blocks of any sizes: one batch per size; None for a block whose slot changed or
        lies outside the arena (the store answered garbage)."""
        by_size: dict[int, list[int]] = {}
        for i, size in enumerate(sizes):
            by_size.setdefault(size, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(offsets)
        with self._in_use():
            for size, batch in by_size.items():
                try:
                    got = self.read_blocks([offsets[i] for i in batch], size, [checksums[i] for i in batch])
                except ValueError:
                    continue
                for i, tensor in zip(batch, got, strict=True):
                    out[i] = tensor
        return out

    def write_many(self, offsets: Sequence[int], blocks: Sequence[Sequence[torch.Tensor | Buffer]]) -> list[int]:
        with self._in_use():
            return super().write_many(offsets, blocks)

    def hold(self) -> bool:
        """One more client shares this opening; False once it is closed."""
        with self._lock:
            if self.closed:
                return False
            self._holders += 1
            return True

    def close(self) -> None:
        """One client lets go; the last one unmaps it (at once, or when the last copy ends)."""
        with self._lock:
            if self.closed:
                return
            self._holders -= 1
            if self._holders:
                return
            self.closed = True
            idle = not self._users
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        self.__dict__.pop("tensor", None)
        self.__dict__.pop("_rows", None)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a tensor over it is still referenced: it goes with that
                self._map.close()
        elif self._ptr:
            import cupy

            with cupy.cuda.Device(self._index):
                torch.cuda.synchronize(self._index)
                cupy.cuda.runtime.ipcCloseMemHandle(self._ptr)
            self._ptr = 0


_ipc_openings: dict[str, OpenedSegment] = {}  # a CUDA IPC handle (hex) -> its one opening in this process
_ipc_lock = threading.Lock()


def open_device_segment(greeting: dict[str, Any], fds: list[int]) -> OpenedSegment:
    """The client's side of a device arena; one opening per CUDA IPC handle in a process, shared."""
    if greeting.get("kind") != "cuda-ipc":
        return OpenedSegment(greeting, fds)
    handle = str(greeting.get("handle"))
    with _ipc_lock:
        opened = _ipc_openings.get(handle)
        if opened is not None and opened.hold():
            return opened
        opened = _ipc_openings[handle] = OpenedSegment(greeting, fds)
        for stale in [h for h, o in _ipc_openings.items() if o.closed]:
            del _ipc_openings[stale]
        return opened


def _device_with_uuid(uuid: str) -> int | None:
    if not uuid or not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == uuid), None)


# -- the tier ------------------------------------------------------------------------------------


class DeviceArenaTier(ArenaTier):
    """Blocks in slots of the device arena; same-node clients reach them through its socket."""

    tier = Tier.DEVICE
    xxh3_slots = False  # slots carry wsum64 checksums, taken where the bytes are

    def __init__(self, directory: Path, capacity: int, device: str = "cuda") -> None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available; use --device cpu or off")
        self.buffer = DeviceArena(capacity, device)
        super().__init__(directory, self.buffer.size)
        self.segment = TensorSegment(self.buffer.tensor)
        self.socket = ArenaSocket(self.buffer, self.dir / "device-arena.sock")
        self._cuda = self.buffer.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.buffer.device) if self._cuda else None
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=self._cuda)
        self._staging_lock = threading.Lock()

    def slot_checksum(self, offset: int, size: int) -> int:
        return wsum64(self.segment.gather([offset], size))[0]

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        """A block from host memory (a put over gRPC, a promotion): through pinned memory on the side stream."""
        offset = self._alloc(len(payload))
        try:
            with self._staging_lock, self._on_side_stream():
                staged = self._stage(len(payload))
                staged.copy_(as_uint8(payload))
                csum = self.segment.write_blocks([offset], [[staged.to(self.buffer.device, non_blocking=True)]])[0]
        except BaseException:
            self.release(offset)
            raise
        self._slots[key] = (offset, len(payload), csum)

    def copy_slot(self, offset: int, size: int, checksum: int) -> bytes | None:
        """To host memory (a demotion, a get over gRPC): through pinned memory on the side stream."""
        with self._staging_lock, self._on_side_stream():
            row = self.segment.gather([offset], size)
            staged = self._stage(row.numel())
            staged.copy_(row.view(-1), non_blocking=True)
            if self._stream is not None:
                self._stream.synchronize()
            ok = wsum64(staged.view(1, -1))[0] == checksum
            return staged[:size].numpy().tobytes() if ok else None

    def _stage(self, size: int) -> torch.Tensor:
        if len(self._staging) < size:
            self._staging = torch.empty(padded(size), dtype=torch.uint8, pin_memory=self._cuda)
        return self._staging[:size]

    def _on_side_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def close(self, timeout_s: float = 30.0) -> None:
        super().close(timeout_s)
        del self.segment
        with contextlib.suppress(BufferError):
            self.buffer.close()
