"""What a service process holds in memory, and whether the kernel's OOM killer ended it: what `kvserve up` says of
a service that was killed. Read without privilege from /proc and from the memory cgroup the process runs in, whose
`oom_kill` count (cgroup v2's memory.events, v1's memory.oom_control) the kernel raises before its SIGKILL."""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUPS = Path("/sys/fs/cgroup")
_PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_S = 2.0  # how often the memory a service holds is read, at least (see `Watch`)
SAMPLE_SHARE = 0.01  # of a core, at most, that reading it takes
LOOKBACK_S = 2.0  # a kill is judged against the OOM count read this long before it was seen (see `Watch`)


def held_bytes(pid: int, proc: Path = PROC) -> int | None:
    """The memory process `pid` holds: its proportional set size (smaps_rollup), where a page shared by n processes
    counts 1/n (so the store's arena, which prefill and decode map too, counts once over the three); its resident
    set size (statm) where smaps_rollup cannot be read; None once it has gone."""
    try:
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int((proc / str(pid) / "statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def size(n: int) -> str:
    """310 MiB, 2.8 GiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def oom_counter(pid: int, proc: Path = PROC, cgroups: Path = CGROUPS) -> Path | None:
    """The file that counts the OOM killer's kills (`oom_kill`) in the memory cgroup process `pid` runs in, as named in
    /proc/PID/cgroup (so read it while the process lives); None where there is none (the root cgroup, no memory
    controller) or it cannot be read."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    counters = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.strip("/")
        if controllers == "":  # v2: at the mount, or beside v1's controllers ("hybrid")
            counters += [cgroups / rel / "memory.events", cgroups / "unified" / rel / "memory.events"]
        elif "memory" in controllers.split(","):
            counters.append(cgroups / "memory" / rel / "memory.oom_control")
    return next((c for c in counters if OomCount.read(c) is not None), None)


@dataclass(frozen=True, slots=True)
class OomCount:
    """The OOM killer's kills so far in a memory cgroup (`oom_kill` in `counter`)."""

    counter: Path
    kills: int

    @classmethod
    def read(cls, counter: Path) -> OomCount | None:
        try:
            for line in counter.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return cls(counter, int(value))
        except (OSError, ValueError):
            pass
        return None


@dataclass(frozen=True, slots=True)
class KillCause:
    """Why a service was killed (SIGKILL), from its cgroup's OOM count before and after, and the memory it held."""

    oom: bool
    text: str  # "the kernel's OOM killer (oom_kill 3 → 4 in /sys/fs/cgroup/…/memory.events); it held 2.8 GiB"

    @property
    def short(self) -> str:
        return "killed: out of memory" if self.oom else "killed by SIGKILL"


def kill_cause(before: OomCount | None, held: int | None) -> KillCause:
    """Reads `before`'s counter again, after the kill: the OOM killer killed the service when its count rose
    (another process of the same cgroup killed with it would raise it too: read `before` shortly before)."""
    after = None if before is None else OomCount.read(before.counter)
    memory = "" if held is None else f"; it held {size(held)}"
    if before is None or after is None:
        return KillCause(False, f"no OOM count readable to tell whether the kernel's OOM killer did it{memory}")
    if after.kills > before.kills:
        return KillCause(True, f"the kernel's OOM killer (oom_kill {before.kills} → {after.kills} in "
                               f"{before.counter}){memory}")
    return KillCause(False, f"not the kernel's OOM killer (oom_kill {after.kills} in {before.counter}, "
                            f"unchanged){memory}")


class Watch:
    """What `kvserve up` keeps of one service process, `poll`ed a few times a second: the memory it held at the last
    two samples (every SAMPLE_S, or less often where smaps_rollup, which walks the page tables, takes more than
    SAMPLE_SHARE of a core: 8 ms for 500 MiB), and its cgroup's OOM count over the last LOOKBACK_S. A kill is judged
    against a count read before it: the kernel raises the count, then the process still runs while the kill
    frees its memory, and a count read then already holds its own kill."""

    def __init__(self, pid: int, proc: Path = PROC, cgroups: Path = CGROUPS) -> None:
        self.pid = pid
        self._proc, self._cgroups = proc, cgroups
        self._held: deque[int] = deque(maxlen=2)
        self._counter: Path | None = None
        self._counts: deque[tuple[float, OomCount]] = deque()  # (time, count), oldest first
        self._sample_at = float("-inf")

    @property
    def held(self) -> int | None:
        """Bytes, at the last sample."""
        return self._held[-1] if self._held else None

    def poll(self, now: float, *, sample: bool = False) -> bool:
        """Reads the OOM count, and what the process holds when that is due (or `sample`); True when it was read."""
        sampled = sample or now >= self._sample_at
        if sampled:
            began = time.perf_counter()
            if held := held_bytes(self.pid, self._proc):  # 0 or None: a process that is exiting, or gone
                self._held.append(held)
            counter = oom_counter(self.pid, self._proc, self._cgroups)
            if counter != self._counter:  # moved to another cgroup: counts of different files do not compare
                self._counter, self._counts = counter, deque()
            self._sample_at = now + max(SAMPLE_S, (time.perf_counter() - began) / SAMPLE_SHARE)
        count = None if self._counter is None else OomCount.read(self._counter)
        if count is not None:
            self._counts.append((now, count))
            while len(self._counts) > 1 and self._counts[1][0] <= now - LOOKBACK_S:
                self._counts.popleft()
        return sampled

    def cause(self) -> KillCause:
        """Why the process, once killed by SIGKILL, was."""
        return kill_cause(self._counts[0][1] if self._counts else None, max(self._held, default=None))
