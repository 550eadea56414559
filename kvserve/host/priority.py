"""CPU priority inside an engine service: the threads that take calls above the engine's (Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

# How far above the service's priority the threads that take calls run where the process may (EnginePriority),
# and the slice they ask for: EEVDF's shortest, 0.1 ms (the default is 0.7 ms times 1 + log2 of the cores).
FRONT_RAISE = 10
FRONT_SLICE_NS = 100_000
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine) if hasattr(os, "uname") else None


class EnginePriority:
    """CPU priority inside an engine service (Linux, where nice is per thread; elsewhere nothing changes): the
    engine computes at the service's own priority plus `engine_nice`, and the threads that take calls (gRPC's
    completion-queue thread and the workers that admit, refuse and stream) run above it, so that on cores the
    engine keeps busy a call is taken, or refused, at once.

    Create it on the main thread before any other thread starts: every thread inherits the raise. The engine's
    threads are its loop (`run`), the threads that start while `starting()` is open (torch's OpenMP workers,
    which loading the model starts), and those these start later (more OpenMP workers, the KV I/O threads)."""

    def __init__(self, engine_nice: int, front_raise: int = FRONT_RAISE) -> None:
        self.enabled = sys.platform == "linux"
        self.base = os.getpriority(os.PRIO_PROCESS, 0) if self.enabled else 0
        # the engine keeps the service's priority and the default slice: beside other work on the host it takes
        # its fair share, as any process does
        self.engine = min(19, self.base + engine_nice)
        self.front = self.base
        self.short_slice = False
        if not self.enabled:
            return
        if front_raise:
            try:  # where the process may: root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it (compose's ulimits)
                os.setpriority(os.PRIO_PROCESS, 0, max(-20, self.base - front_raise))
                self.front = os.getpriority(os.PRIO_PROCESS, 0)
            except PermissionError:
                log.info("the threads that take calls keep the service's priority: raising them needs CAP_SYS_NICE "
                         "or RLIMIT_NICE (docs/OPERATIONS.md, \"CPU priority\")")
        # everywhere on Linux 6.12 or later, no privilege needed: a thread woken by a call preempts a running
        # step instead of waiting out its slice
        self.short_slice = _set_slice(0, self.front, FRONT_SLICE_NS)
        log.info("CPU priority: the threads that take calls at nice %d%s, the engine's at nice %d", self.front,
                 f" with a {FRONT_SLICE_NS // 1000} us slice" if self.short_slice else "", self.engine)

    @property
    def changes(self) -> bool:
        return self.enabled and (self.front != self.engine or self.short_slice)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Puts the threads started within at the engine's priority (nothing of the gRPC server's may start there)."""
        before = _thread_ids() if self.changes else set()
        try:
            yield
        finally:
            if self.changes:
                self._lower_started(before)

    def run(self, loop: Callable[[], None]) -> Callable[[], None]:
        """`loop` (the engine's step loop), run at the engine's priority on the thread that calls it."""

        def run() -> None:
            self._lower(threading.get_native_id())
            loop()

        return run

    def _lower_started(self, before: set[int]) -> None:
        if not before:  # a process has a thread: /proc is not there
            log.warning("/proc/self/task is not readable, so torch's threads run at the priority of the threads "
                        "that take calls; only the engine's loop is put at its own")
            return
        started = _thread_ids() - before
        for tid in started:
            self._lower(tid)
        log.info("the engine's loop and %d threads started as the model loaded run at nice %d", len(started),
                 self.engine)

    def _lower(self, tid: int) -> None:
        if not self.changes:
            return
        with contextlib.suppress(ProcessLookupError):  # the thread has ended
            if self.short_slice:
                _set_slice(tid, self.engine, 0)  # also sets its nice
            else:
                os.setpriority(os.PRIO_PROCESS, tid, self.engine)


def _set_slice(tid: int, nice: int, slice_ns: int) -> bool:
    """Thread `tid`'s (0: the caller's) nice and scheduler slice (`slice_ns`, 0: the default), by sched_setattr:
    False where the kernel or the platform has no such call (a custom slice for SCHED_OTHER came in Linux 6.12;
    before, the kernel takes the call and ignores the slice)."""
    if _SYS_SCHED_SETATTR is None:
        return False
    # struct sched_attr: size, policy (SCHED_OTHER), flags, nice, priority, runtime (the slice), deadline, period
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0))
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(_SYS_SCHED_SETATTR, tid, attr, 0) == 0
    except (AttributeError, OSError):
        return False


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()
