"""Processes and ports on this machine, as tests of real processes see them: free loopback ports, a
process's children, whether it is alive, the shared-memory arenas it maps, and the `kvserve` command."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

KVSERVE = str(Path(sys.executable).with_name("kvserve"))


def free_ports(n: int) -> list[int]:
    """n loopback ports free now (bound and closed again at once)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def memfd_inodes(pid: int | str = "self") -> set[str]:
    """The shared-memory arenas (kvstore/arena.py) process `pid` maps, by inode."""
    return {line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/memfd:kvserve-arena" in line}
