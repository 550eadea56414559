"""`kvserve up`'s supervisor: starts again a service of its stack that dies, and keeps DATA_DIR/up.json.

A service that exits while `up` runs is reported in one line (how it ended, for a SIGKILL whether the
kernel's OOM killer sent it and what it held, and its own last log lines), a dead store's shared-memory dir
is removed, and the service is started again with the same flags on the same port after a backoff
(protos.retry.Backoff). Until the new process listens, a placeholder holds the port and answers every call with
UNAVAILABLE (HTTP: 503) and the reason (stack.placeholder). The others keep running: their channels
reconnect to the new process. A file the service reads as it starts (its credentials, its model's files)
that is missing or unreadable is said in one line with what to do, and looked for again at each delay: the
service starts once it is back. A failure that retrying cannot fix ends `up` (`Unrecoverable`). What each
service holds is sampled every couple of seconds for up.json (stack.memory.Watch).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvserve.stack.memory import KillCause, Watch, size
from kvserve.stack.placeholder import Placeholder, restarting
from kvserve.stack.stack import (
    METRICS_OFFSETS,
    Service,
    Stack,
    StackError,
    StartFailed,
    flag_value,
    log_lines,
    port_in_use,
    remove_shm_leftovers,
    unreadable,
    wait_started,
)
from kvserve.stack.status import (
    ExitStatus,
    ServiceStatus,
    UpStatus,
    describe_exit,
    read_status,
    write_status,
)
from protos.retry import Backoff

UNRECOVERABLE_EXIT_CODE = 2  # what a service exits with when its flags, model or port cannot work


class Unrecoverable(Exception):
    """A service that starting again cannot bring back: `kvserve up` stops, exit code 2."""


@dataclass(slots=True)
class _Child:
    name: str
    service: Service  # its current process (the dead one while waiting)
    backoff: Backoff
    state: str = "running"
    restarts: int = 0
    restart_at: float = 0.0  # monotonic, while waiting
    starting: Future[Service] | None = None
    last_exit: ExitStatus | None = None
    watch: Watch = field(init=False)  # of its current process: memory held, its cgroup's OOM count
    placeholder: Placeholder | None = None  # on its port while it is down
    files: list[Path] = field(default_factory=list)  # what it read as it first started (ServiceSpec.files)
    not_started: str = ""  # why it was last not started (said once while it stays the same)

    def __post_init__(self) -> None:
        self.watch = Watch(self.service.process.pid)


class Supervisor:
    """Watches a started Stack: call `poll` from the main thread a few times a second (it starts
    processes, see `kvserve.stack.stack.spawn_service`), and `close` once the stack has stopped."""

    def __init__(self, stack: Stack, status_path: Path | None = None, *, stopping: Callable[[], bool] = lambda: False,
                 backoff: Callable[[], Backoff] = Backoff, out: TextIO | None = None, err: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stack = stack
        self.status_path = status_path
        self._stopping = stopping
        self._out, self._err = out or sys.stdout, err or sys.stderr
        self._clock = clock
        self._status_failed = False
        self.started_at = min((s.started_at for s in stack.services), default=time.time())
        self.children = [_Child(s.name, s, backoff(), files=stack.specs[s.name].files) for s in stack.services]
        for child in self.children:
            child.watch.poll(self._clock())
        self.write_status()

    def poll(self) -> None:
        """Reports a service that exited and schedules its start; starts those whose delay is over;
        takes in those that started (or failed to). Raises Unrecoverable."""
        for child in self.children:
            if self._stopping():
                return  # `up` is stopping: a service that exits now was told to (Ctrl-C reaches all)
            if child.state == "running" and child.service.process.poll() is not None:
                self._exited(child)
            elif child.state == "waiting" and self._clock() >= child.restart_at:
                self._start_again(child)
            elif child.state == "starting" and child.starting is not None and child.starting.done():
                self._started(child)
        sampled = [c.watch.poll(self._clock()) for c in self.children if c.state != "waiting"]
        if any(sampled):
            self.write_status()

    def status(self) -> UpStatus:
        layout = self.stack.layout
        names = [s.name for s in self.stack.services]
        return UpStatus(os.getpid(), self.started_at, time.time(), self.stack.addr,
                        {c.name: self._service_status(c) for c in self.children}, insecure=layout is None,
                        credentials=None if layout is None else str(layout.root.resolve()),
                        ca=None if layout is None else str(layout.ca.resolve()),
                        admin_token=None if layout is None else str(layout.admin_token.resolve()),
                        http_url=self.stack.service("http").url if "http" in names else None)

    def write_status(self) -> None:
        if self.status_path is None:
            return
        try:
            write_status(self.status_path, self.status())
        except OSError as exc:
            if not self._status_failed:
                self._say(f"kvserve up: cannot write {self.status_path} ({exc}); `kvserve stats` will not "
                          "show the restarts", self._err)
            self._status_failed = True

    def close(self) -> None:
        """Closes the placeholders and removes the status file: `up` has stopped."""
        for child in self.children:
            if child.placeholder is not None:
                child.placeholder.close()
        if self.status_path is not None:
            with contextlib.suppress(OSError):
                status = read_status(self.status_path.parent)
                if status is None or status.pid == os.getpid():
                    self.status_path.unlink(missing_ok=True)

    # -- internals -----------------------------------------------------------------------------

    def _exited(self, child: _Child) -> None:
        proc = child.service.process
        ran_s = max(0.0, time.time() - child.service.started_at)
        cause = self._kill_cause(child, proc.returncode)
        child.last_exit = ExitStatus.of(proc.returncode, time.time(), None if cause is None else cause.text)
        self._hold_port(child, cause.short if cause else describe_exit(proc.returncode).removeprefix("was "))
        cleaned = self._clean_up(child)
        delay = child.backoff.delay(ran_s)
        child.state, child.restart_at = "waiting", self._clock() + delay
        self.write_status()
        self._say(f"kvserve up: {child.name} (pid {proc.pid}) {describe_exit(proc.returncode)} after "
                  f"{duration(ran_s)}{'' if cause is None else f': {cause.text}'}{cleaned}; starting it again in "
                  f"{delay:g} s{self._last_lines(child)}", self._err)

    def _start_again(self, child: _Child) -> None:
        host, spec = self.stack.config.host, self.stack.specs[child.name]
        if missing := unreadable(child.files):
            self._not_started(child, self._files_missing(missing), "a file it reads is missing")
            return
        shared = child.placeholder is not None  # it holds the service's own port
        taken = [p for p in spec.ports if port_in_use(host, p, shared=shared and p == spec.port)]
        if taken:
            raise Unrecoverable(f"cannot start {child.name} again: port {taken[0]} on {host} is taken by "
                                "another process")
        try:
            child.service = self.stack.respawn(child.name, share_port=shared)
        except OSError as exc:  # a file gone since the check, its log folder, a fork refused: nothing started
            missing = unreadable(child.files)
            self._not_started(child, self._files_missing(missing) if missing else str(exc),
                              "a file it reads is missing" if missing else "it could not be started")
            return
        child.not_started = ""
        child.state, child.restarts = "starting", child.restarts + 1
        child.watch = Watch(child.service.process.pid)
        child.watch.poll(self._clock())
        listening = None if child.placeholder is None else child.placeholder.close
        child.starting = _in_thread(functools.partial(wait_started, listening=listening), child.service)
        self.write_status()

    def _started(self, child: _Child) -> None:
        assert child.starting is not None
        try:
            child.starting.result()
        except Exception as exc:  # noqa: BLE001 - whatever stopped it, it is started again
            self._failed_to_start(child, exc if isinstance(exc, StackError) else StackError(repr(exc)))
            return
        finally:
            child.starting = None
        if child.placeholder is not None:
            child.placeholder.close()  # closed as the new process said it listens
            child.placeholder = None
        child.state = "running"
        child.watch.poll(self._clock(), sample=True)
        self.write_status()
        held = child.watch.held
        self._say(f"kvserve up: {child.name} is back on {child.service.addr} (pid {child.service.process.pid}, "
                  f"restart {child.restarts}{'' if held is None else f', {size(held)} resident'})", self._out)

    def _failed_to_start(self, child: _Child, exc: StackError) -> None:
        code = child.service.process.wait()  # wait_started has killed it if it still ran
        reason = exc.reason if isinstance(exc, StartFailed) else str(exc)
        cause = self._kill_cause(child, code) if reason.startswith(describe_exit(code)) else None  # not our kill
        child.last_exit = ExitStatus.of(code, time.time(), None if cause is None else cause.text)
        if cause is not None:
            reason += f": {cause.text}"
        self._hold_port(child, f"failed to start again: {cause.short if cause else reason}")
        cleaned = self._clean_up(child)
        if code == UNRECOVERABLE_EXIT_CODE:
            if missing := unreadable(child.files):  # gone as it started: not its flags
                self._not_started(child, self._files_missing(missing), "a file it reads is missing")
                return
            self.write_status()
            raise Unrecoverable(f"cannot start {child.name} again: it {reason} (bad flags, or a port or model "
                                f"it cannot use){self._last_lines(child)}")
        delay = child.backoff.delay(None)
        child.state, child.restart_at = "waiting", self._clock() + delay
        self.write_status()
        then = (f"it keeps failing to start: trying again every {delay:g} s until it starts or `up` is stopped"
                if delay >= child.backoff.max_s else f"trying again in {delay:g} s")
        self._say(f"kvserve up: {child.name} failed to start again (attempt {child.restarts}): it {reason}"
                  f"{cleaned}; {then}{self._last_lines(child)}", self._err)

    def _not_started(self, child: _Child, why: str, short: str) -> None:
        """Leaves a service down for another delay without starting it, saying `why` unless it said so last (its
        placeholder says `short`, which names no file to callers)."""
        delay = child.backoff.delay(None)
        child.state, child.restart_at = "waiting", self._clock() + delay
        self._hold_port(child, short)
        self.write_status()
        if why != child.not_started:
            self._say(f"kvserve up: cannot start {child.name} again: {why}; looking again in {delay:g} s, then at "
                      f"growing delays up to {child.backoff.max_s:g} s; the other services keep serving", self._err)
        child.not_started = why

    def _files_missing(self, missing: dict[Path, str]) -> str:
        """Which files of a service cannot be read, and what brings them back."""
        layout, model = self.stack.layout, self.stack.config.model_dir
        of_model = [p for p in missing if p.is_relative_to(model)]  # which may lie in the data dir
        credentials = [p for p in missing if layout is not None and p.is_relative_to(layout.root) and p not in of_model]
        todo = []
        if layout is not None and layout.ca in credentials:
            todo.append("restore them from a backup and it starts by itself, or stop `kvserve up` and start it again "
                        f"to make a new CA and credentials (not `kvserve credentials {layout.root}` while `up` runs: "
                        "a new CA would not match the certificates the running services hold)")
        elif layout is not None and credentials:
            todo.append(f"restore them from a backup, or make them again with `kvserve credentials {layout.root}`; "
                        "it starts by itself once they are there")
        if of_model:
            todo.append(f"put the model folder {model} back and it starts by itself")
        files = ", ".join(f"{path} ({why})" for path, why in missing.items())
        return f"{files}; {'; '.join(todo) or 'restore them and it starts by itself'}"

    def _hold_port(self, child: _Child, why: str) -> None:
        """Has a placeholder answer on the port of a service that is down, saying `why`."""
        message = restarting(child.name, why)
        if child.placeholder is not None and not child.placeholder.closed:
            child.placeholder.message = message
        else:
            child.placeholder = Placeholder.open(self.stack.specs[child.name], message)

    @staticmethod
    def _kill_cause(child: _Child, returncode: int) -> KillCause | None:
        """For a service that died by SIGKILL, whether the kernel's OOM killer sent it, and what it held."""
        return child.watch.cause() if returncode == -signal.SIGKILL else None

    def _clean_up(self, child: _Child) -> str:
        """Removes what a dead store leaves in shared memory; says what was removed ("" if nothing)."""
        spec = self.stack.specs[child.name]
        if spec.module != "kvstore":
            return ""
        root = Path(flag_value(spec.args, "--shm-root") or "/dev/shm")
        removed = remove_shm_leftovers(child.service.process.pid, root)
        return "".join(f"; removed its shared memory {d}" for d in removed)

    def _last_lines(self, child: _Child) -> str:
        s = child.service
        if s.log_path is None:
            return ""
        lines = [line if len(line) <= 300 else line[:297] + "..." for line in log_lines(s.log_path, 3, s.log_offset)]
        return f"; its last log lines: {' | '.join(lines)}" if lines else f"; it wrote nothing to {s.log_path}"

    def _service_status(self, child: _Child) -> ServiceStatus:
        s = child.service
        running = child.state != "waiting"
        return ServiceStatus(child.state, s.process.pid if running else None, s.addr, child.restarts,
                             s.started_at if running else None, child.last_exit,
                             str(s.log_path) if s.log_path else None, metrics_url(self.stack, child.name),
                             child.watch.held if running else None)

    @staticmethod
    def _say(line: str, stream: TextIO) -> None:
        print(line, file=stream, flush=True)


def metrics_url(stack: Stack, name: str) -> str | None:
    """Service `name`'s Prometheus page (https when the stack is secure); None without --metrics-base-port."""
    base = stack.config.metrics_base_port
    if base is None or name not in METRICS_OFFSETS:
        return None
    scheme = "http" if stack.layout is None else "https"
    return f"{scheme}://{stack.service(name).host}:{base + METRICS_OFFSETS[name]}/metrics"


def duration(seconds: float) -> str:
    """12 s, 5 min, 3.5 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _in_thread(fn: Callable[[Service], Service], service: Service) -> Future[Service]:
    future: Future[Service] = Future()

    def run() -> None:
        try:
            future.set_result(fn(service))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            future.set_exception(exc)

    threading.Thread(target=run, name=f"kvserve-up-start-{service.name}", daemon=True).start()
    return future
