"""Cores shared by the compute services of one host: each computes on its own budget of threads, and on the
budgets of the others while they have nothing to compute (docs/OPERATIONS.md, "CPU threads"). A fixed split
keeps two OpenMP teams from stalling at each other's barriers, but leaves a core idle whenever one service
computes alone (in a chat, decode computes each turn's new tokens while prefill waits). So the services of a
host share a folder with one lock file each, named for the service and holding its budget:

- a service holds its own file's lock (``flock``, exclusive) while its engine has work;
- before each step it takes, without waiting, every other file's lock, computes on its budget plus theirs,
  and lets them go after the step: an owner waits at most one step, and the threads never exceed the budgets;
- it holds a shared lock on ``name.alive`` while it runs: a peer that finds that free removes both files, so
  a dead service's budget is never counted beside its successor's.

Locks die with their process. Torch is not imported here: the engine passes its thread setter.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# How long a service that gets work waits for a peer to give back its cores (one step of the peer's, normally)
# before it computes anyway: a peer stuck in a step must not stop this one.
TAKE_BACK_WAIT_S = 2.0
_POLL_S = 0.001
_WANT_AT = 16  # the byte of a lock file that says its owner is waiting for its cores ("1") or not ("0")


def service_share(folder: str | None, service: str, threads: int, device: str) -> CoreShare | None:
    """A compute service's place in ``folder`` (--share-cores), under its name, host name (a container's own)
    and process id, computing on torch's threads; None when no folder is given, or on CUDA, where the GPU
    computes and the budget is no share of the host's cores. A restarted service comes back under another
    name: the first peer to look removes the files of the one that died."""
    if not folder or str(device).startswith("cuda"):
        return None
    import torch  # only a service that computes on the CPU sets torch's threads

    name = f"{service}-{socket.gethostname()}-{os.getpid()}"
    share = CoreShare(folder, name, threads, torch.set_num_threads)
    log.info("sharing cores with the services in %s: %d threads of its own, more while they are idle", folder,
             threads)
    return share


class CoreShare:
    """One compute service's place in a host's shared folder of budgets (``folder``/``name``.lock)."""

    def __init__(self, folder: str | Path, name: str, threads: int, set_threads: Callable[[int], None],
                 cores: int | None = None, *, take_back_wait_s: float = TAKE_BACK_WAIT_S) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.folder = Path(folder)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # its services' user's alone
        self.name = name
        self.threads = threads
        self._set_threads = set_threads
        self._take_back_wait_s = take_back_wait_s
        # never more threads than this process's cores (default: its affinity), whatever a file in the folder says
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._most = max(threads, cores)
        self._alive = _lock_alive(self.folder / f"{name}.alive")
        self._own = os.open(self.folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._peers: dict[str, int] = {}  # file name -> fd, opened as they appear
        self._borrowed: list[int] = []  # fds of the peers' locks taken for this step
        self._current = threads
        self._owed = False  # our cores were not given back in time: our file says we want them until they are
        # Held from the start (the model is loaded, the pool and the packed weights are being made on our
        # cores) until the engine first has nothing to do. The file is rewritten only by its lock's holder.
        self._holding = self._take_back()
        os.ftruncate(self._own, 0)
        os.pwrite(self._own, f"{threads}\n".encode().ljust(_WANT_AT, b" ") + (b"1" if self._owed else b"0"), 0)

    @property
    def current(self) -> int:
        """The threads the service computes on now."""
        return self._current

    @property
    def holding(self) -> bool:
        """Whether the service holds its own cores: no peer computes on them until it is idle."""
        return self._holding

    def busy(self) -> None:
        """Before a step: hold our own lock (taking our cores back from a peer, waiting at most one of its
        steps, `take_back_wait_s` at worst) and every idle peer's; compute on our budget plus theirs."""
        if not self._holding:
            self._holding = self._take_back()
        self._apply(self.threads + self._borrow_idle_peers())

    def step_done(self) -> None:
        """After a step: give back the peers' locks (their service may start at once)."""
        for fd in self._borrowed:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._borrowed.clear()

    def idle(self) -> None:
        """Nothing to compute: let go of our own lock, so that peers may compute on our cores."""
        self.step_done()
        self._clear_owed()
        if self._holding:
            fcntl.flock(self._own, fcntl.LOCK_UN)
            self._holding = False

    def close(self) -> None:
        self.idle()
        for fd in [self._own, self._alive, *self._peers.values()]:
            os.close(fd)
        self._peers.clear()

    def _take_back(self) -> bool:
        """Our own lock, waiting for the peer that borrowed it to end its step; while we wait our file says
        so, and a peer that reads it does not borrow again. Past `take_back_wait_s` we compute anyway (a peer
        stuck in a step must not stop this service); the file keeps saying so, and each later step only
        tries the lock once, until we hold it or go idle."""
        if _try_lock(self._own):
            self._clear_owed()
            return True
        if self._owed:
            return False
        os.pwrite(self._own, b"1", _WANT_AT)
        deadline = time.monotonic() + self._take_back_wait_s
        while not _try_lock(self._own):
            if time.monotonic() > deadline:
                log.warning("a peer in %s held this service's cores for over %.0f s; computing anyway until it "
                            "gives them back", self.folder, self._take_back_wait_s)
                self._owed = True
                return False
            time.sleep(_POLL_S)
        os.pwrite(self._own, b"0", _WANT_AT)
        return True

    def _clear_owed(self) -> None:
        if self._owed:
            os.pwrite(self._own, b"0", _WANT_AT)
            self._owed = False

    def _borrow_idle_peers(self) -> int:
        """Take the lock of each idle peer (into ``_borrowed`` at once); the threads of their budgets."""
        try:
            names = sorted(p.name for p in os.scandir(self.folder) if p.name.endswith(".lock"))
        except OSError:
            return 0
        for gone in set(self._peers) - set(names):  # removed: a later file of that name is another
            os.close(self._peers.pop(gone))
        extra = 0
        for name in names:
            if name == f"{self.name}.lock":
                continue
            fd = self._peers.get(name)
            if fd is None:
                try:
                    fd = self._peers[name] = os.open(self.folder / name, os.O_RDWR)
                except OSError:
                    continue
            if not _try_lock(fd):
                continue
            if os.fstat(fd).st_nlink == 0:  # removed and made again since we opened it: open the new one next step
                os.close(self._peers.pop(name))
                continue
            if self._remove_if_gone(name):
                continue
            threads, wanted = _read(fd)
            if threads and not wanted:
                self._borrowed.append(fd)
                extra += threads
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return extra

    def _remove_if_gone(self, name: str) -> bool:
        """Whether the service of the lock file ``name`` has exited (its alive file is free or missing); then
        both its files are removed."""
        stem = name.removesuffix(".lock")
        try:
            alive = os.open(self.folder / f"{stem}.alive", os.O_RDWR)
        except OSError:
            alive = -1
        try:
            if alive >= 0 and not _try_lock(alive):
                return False  # it runs
            for suffix in (".lock", ".alive"):
                with contextlib.suppress(OSError):
                    (self.folder / f"{stem}{suffix}").unlink()
            os.close(self._peers.pop(name))
            return True
        finally:
            if alive >= 0:
                os.close(alive)

    def _apply(self, threads: int) -> None:
        threads = min(threads, self._most)
        if threads != self._current:
            self._set_threads(threads)
            self._current = threads


def _lock_alive(path: Path) -> int:
    """``path`` opened and share-locked for the life of this process; if a peer removed it as stale between
    our open and our lock, the file there now is another: open again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def _read(fd: int) -> tuple[int, bool]:
    """(the budget a peer's file names, or 0 for one not written or unreadable; whether its owner waits)."""
    try:
        data = os.pread(fd, _WANT_AT + 1, 0)
        text = data[:_WANT_AT].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return 0, False
    threads = int(text) if text.isdigit() and 0 < int(text) <= 4096 else 0
    return threads, data[_WANT_AT:] == b"1"
