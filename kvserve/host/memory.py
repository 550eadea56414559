"""The memory a service's cache takes at most by default: a share of what the host, or its container, has
available at start."""

from __future__ import annotations

from pathlib import Path

# The share of the memory available at start that a cache takes at most by default: each engine's KV pool
# (--kv-cache-memory, engine.kv_cache) and the store's host tier (--host-capacity). Each takes its memory as
# it fills.
MEMORY_SHARE = 0.2


def memory_cap() -> int | None:
    """MEMORY_SHARE of `available_memory()`; None where it cannot be read."""
    available = available_memory()
    return int(MEMORY_SHARE * available) if available else None


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still take: the kernel's MemAvailable, or less where the memory cgroup it runs in
    (a container's, cgroup v2) has a limit closer by; None where neither can be read."""
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        folder = cgroup / rel.strip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        pass
    return max(0, min(found)) if found else None
