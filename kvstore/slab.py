"""Slab allocation of fixed-size slots in one buffer, as memcached does: the store's arenas (the
host tier's shared memory, the device tier's GPU buffer) hand out slots through it.

A class per slot size (block sizes rounded up to 64 bytes; a deployment has one full-block size
and a few tail sizes) carves runs of 4 MiB pages into slots; a run whose slots are all free goes
back, for any class. Free slots are reused oldest first, so a slot a reader was just told about
is the last to be written again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PAGE_BYTES = 4 << 20
SLOT_ALIGN = 64
MIN_SLOTS_PER_RUN = 16  # a run spans enough pages that rounding wastes at most 1/16 of it


def slot_bytes(size: int) -> int:
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(slots=True)
class SlabClass:
    slot: int  # bytes per slot
    run_pages: int  # pages per run
    free: deque[int] = field(default_factory=deque)  # free slot offsets, reused oldest first
    used: dict[int, int] = field(default_factory=dict)  # run start -> slots in use


class SlabAllocator:
    """Offsets of slots in a buffer of `capacity` bytes (rounded up to pages). Not thread-safe: the
    store's lock guards it."""

    def __init__(self, capacity: int, page_bytes: int = PAGE_BYTES) -> None:
        self.page_bytes = page_bytes
        num_pages = max(1, -(-capacity // page_bytes))
        self.size = num_pages * page_bytes
        self._pages = bytearray(num_pages)  # 1: page belongs to a run
        self._classes: dict[int, SlabClass] = {}
        self._owner: dict[int, SlabClass] = {}  # slot in use -> its class
        self._run_of: dict[int, int] = {}  # every slot of every run -> its run's start

    def alloc(self, size: int) -> int | None:
        """The offset of a free slot for `size` bytes, or None when none can be had."""
        cls = self._class(size)
        if cls is None or (not cls.free and not self._add_run(cls)):
            return None
        offset = cls.free.popleft()
        run = self._run_of[offset]
        cls.used[run] = cls.used.get(run, 0) + 1
        self._owner[offset] = cls
        return offset

    def free(self, offset: int) -> None:
        cls = self._owner.pop(offset)
        run = self._run_of[offset]
        cls.used[run] -= 1
        cls.free.append(offset)
        if cls.used[run] == 0:  # the run's pages go back, for any class
            del cls.used[run]
            slots = self._slots(cls, run)
            for o in slots:
                del self._run_of[o]
            gone = set(slots)
            cls.free = deque(o for o in cls.free if o not in gone)
            first = run // self.page_bytes
            self._pages[first : first + cls.run_pages] = bytes(cls.run_pages)

    def has_room(self, size: int) -> bool:
        cls = self._class(size)
        return cls is not None and (bool(cls.free) or self._find_run(cls.run_pages) >= 0)

    def slot_size(self, offset: int) -> int | None:
        """The size of the slot in use at `offset`, or None if no slot is in use there."""
        owner = self._owner.get(offset)
        return None if owner is None else owner.slot

    def _class(self, size: int) -> SlabClass | None:
        slot = slot_bytes(max(size, 1))
        cls = self._classes.get(slot)
        if cls is None:
            run_pages = -(-slot * MIN_SLOTS_PER_RUN // self.page_bytes)
            if run_pages > len(self._pages):
                run_pages = -(-slot // self.page_bytes)  # a small arena: fewer slots per run
                if run_pages > len(self._pages):
                    return None
            cls = self._classes[slot] = SlabClass(slot, run_pages)
        return cls

    def _slots_per_run(self, cls: SlabClass) -> int:
        return cls.run_pages * self.page_bytes // cls.slot

    def _slots(self, cls: SlabClass, run: int) -> list[int]:
        return [run + i * cls.slot for i in range(self._slots_per_run(cls))]

    def _find_run(self, pages: int) -> int:
        return self._pages.find(bytes(pages))

    def _add_run(self, cls: SlabClass) -> bool:
        first = self._find_run(cls.run_pages)
        if first < 0:
            return False
        self._pages[first : first + cls.run_pages] = b"\x01" * cls.run_pages
        run = first * self.page_bytes
        slots = self._slots(cls, run)
        self._run_of.update((o, run) for o in slots)
        cls.free.extend(slots)
        return True
