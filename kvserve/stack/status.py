"""What `kvserve up` writes to DATA_DIR/up.json and what the other commands read from it. Kept apart from the
supervisor, with nothing heavy to import: `kvserve health`, which container probes run every few seconds, reads
it too (kvserve/cli/health.py)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from client.local import LOCAL_HOSTS, Layout

STATUS_FILE = "up.json"


def describe_exit(returncode: int) -> str:
    """"exited with code 1" or "was killed by SIGKILL" (Popen's negative return codes)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


@dataclass(frozen=True, slots=True)
class ExitStatus:
    code: int | None  # its exit code; None when a signal ended it
    signal: str | None  # the signal that ended it, e.g. "SIGKILL"
    at: float  # Unix time
    cause: str | None = None  # of a SIGKILL: whether the kernel's OOM killer sent it, and the memory it held

    @classmethod
    def of(cls, returncode: int, at: float, cause: str | None = None) -> ExitStatus:
        if returncode >= 0:
            return cls(returncode, None, at, cause)
        return cls(None, describe_exit(returncode).removeprefix("was killed by "), at, cause)

    def __str__(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exited with code {self.code}"
        return how if self.cause is None else f"{how}: {self.cause}"


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    state: str  # running; starting (again); waiting (to be started again)
    pid: int | None  # None while waiting
    addr: str
    restarts: int  # times it was started again
    started_at: float | None  # Unix time its current process started
    last_exit: ExitStatus | None
    log: str | None
    metrics_url: str | None = None  # its Prometheus page (`up --metrics-base-port`)
    memory_bytes: int | None = None  # what it holds (stack.memory.held_bytes), sampled every few seconds


@dataclass(frozen=True, slots=True)
class UpStatus:
    """DATA_DIR/up.json while `kvserve up` runs there: what its services are doing (`kvserve stats` shows it),
    and what a later command needs to reach them (`kvserve generate`, `chat`, `stats` and `health` read it)."""

    pid: int  # of `kvserve up`
    started_at: float
    updated_at: float
    front_door: str
    services: dict[str, ServiceStatus]  # in start order: kvstore, prefill, decode, http
    insecure: bool = False  # plaintext, no tokens: the four below are None
    credentials: str | None = None  # the folder of its CA, certificates and tokens (client/local.py's Layout)
    ca: str | None = None  # what a client trusts (--tls-ca)
    admin_token: str | None = None  # the admin's bearer token (--token)
    http_url: str | None = None  # OpenAI's API, in front of decode

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> UpStatus:
        services = {
            name: ServiceStatus(**{**s, "last_exit": ExitStatus(**s["last_exit"]) if s["last_exit"] else None})
            for name, s in d["services"].items()
        }
        return cls(**{**d, "pid": int(d["pid"]), "services": services})

    @property
    def layout(self) -> Layout | None:
        return None if self.credentials is None else Layout(Path(self.credentials))

    def serves(self, addr: str) -> bool:
        """Whether `addr` is one of its services' on this host."""
        host, _, port = addr.rpartition(":")
        return host in LOCAL_HOSTS and any(s.addr.rpartition(":")[2] == port for s in self.services.values())

    def credentials_of(self, addr: str) -> Layout | None:
        """Its credentials, when it serves `addr` and they are all there."""
        layout = self.layout
        return layout if layout is not None and self.serves(addr) and layout.complete() else None


def no_up(data_dir: Path) -> str:
    """That no `kvserve up` runs on `data_dir`, as the commands say it."""
    return f"no `kvserve up` runs in {data_dir} (no {data_dir / STATUS_FILE})"


def read_status(data_dir: Path) -> UpStatus | None:
    """What the `kvserve up` running on data_dir wrote; None when there is none (or it has died)."""
    try:
        status = UpStatus.from_json(json.loads((data_dir / STATUS_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(status.pid, 0)
    except OSError:  # gone, or another user's process now
        return None
    return status


def write_status(path: Path, status: UpStatus) -> None:
    """Replaces the file at once (a reader sees the old or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status.to_json(), indent=2) + "\n")
    os.replace(tmp, path)
