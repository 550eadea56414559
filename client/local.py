"""Where a node's credentials lie, and how a client on the same host finds those of a `kvserve up`
(docs/DESIGN.md, "Secure by default").

`kvserve credentials DIR` (and the first `kvserve up`, on its data dir) writes:

- ``certs/``: the CA (``ca.pem``, and ``ca-key.pem``, which can make certificates every service trusts)
  and each service's certificate and key (``kvstore``, ``prefill``, ``decode``, ``router``);
- ``admin/``: the master credentials, kept apart from the services' own: ``admin.pem`` and its key, a
  certificate from the CA that the store and prefill accept like a service's (it can read and write
  every tenant's blocks), and ``admin.token``, the front door's token of tenant ``admin``;
- ``auth/``: what the services read: ``tokens`` (tenants' token hashes), ``tokens.secret`` (keys each
  tenant's cache namespace), ``service-tokens`` and ``router.token`` (the router's token for decode's
  internal API), ``record.key`` (the store's MAC key for the records it writes to its tiers).

A running `kvserve up` names its data dir in KVSERVE_HOME/up/PORT.json (KVSERVE_HOME: $KVSERVE_HOME,
else ~/.kvserve), one file per port its services listen on, as a local server leaves a socket where
its clients look. A client that dials such a port on this host, given no token or CA, reads it and
uses the CA and the admin token (`Client`), or the admin certificate (`kvserve health`, `stats`).
The files are removed when `up` stops.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import grpc

HOME_ENV = "KVSERVE_HOME"
ADMIN_TENANT = "admin"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class ClientCredentials(TypedDict):
    """`Client(addr, **credentials)`."""

    token: str
    tls_ca: str


@dataclass(frozen=True, slots=True)
class Layout:
    """The files of a credentials folder (the module's docstring says what each is)."""

    root: Path

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def ca(self) -> Path:
        return self.certs / "ca.pem"

    def cert(self, name: str) -> tuple[Path, Path]:
        """A service's certificate and key."""
        return self.certs / f"{name}.pem", self.certs / f"{name}-key.pem"

    @property
    def admin(self) -> Path:
        return self.root / "admin"

    @property
    def admin_cert(self) -> tuple[Path, Path]:
        return self.admin / "admin.pem", self.admin / "admin-key.pem"

    @property
    def admin_token(self) -> Path:
        return self.admin / "admin.token"

    @property
    def auth(self) -> Path:
        return self.root / "auth"

    @property
    def tokens(self) -> Path:
        return self.auth / "tokens"

    @property
    def tokens_secret(self) -> Path:
        return self.auth / "tokens.secret"

    @property
    def service_tokens(self) -> Path:
        return self.auth / "service-tokens"

    @property
    def router_token(self) -> Path:
        return self.auth / "router.token"

    @property
    def record_key(self) -> Path:
        return self.auth / "record.key"

    def tls_flags(self, name: str) -> list[str]:
        """The flags that serve service `name` with its certificate."""
        cert, key = self.cert(name)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca)]

    def admin_credentials(self) -> grpc.ChannelCredentials:
        """TLS that trusts the CA and presents the admin certificate (`kvserve health`, `stats`)."""
        cert, key = self.admin_cert
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), key.read_bytes(), cert.read_bytes())

    def client_kwargs(self) -> ClientCredentials:
        """`Client`'s token and tls_ca as the admin (a stack's own tools and tests)."""
        return {"token": self.admin_token.read_text(encoding="utf-8").strip(), "tls_ca": str(self.ca)}

    def complete(self) -> bool:
        """Whether the files a local client needs are there."""
        return all(p.is_file() for p in (self.ca, self.admin_token, *self.admin_cert))


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".kvserve")


def _entry(port: int) -> Path:
    return home() / "up" / f"{port}.json"


def register(ports: Sequence[int], data_dir: Path) -> None:
    """Names `data_dir` as the credentials of the servers on `ports` of this host (`kvserve up` at start)."""
    for port in ports:
        path = _entry(port)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"port": port, "data_dir": str(data_dir.resolve()), "pid": os.getpid()}))
        os.replace(tmp, path)


def unregister(ports: Sequence[int], data_dir: Path | None = None) -> None:
    """Removes the entries of `ports` that still name `data_dir` (`kvserve up` as it stops), or whichever they
    name (None: an `up --insecure` now serves those ports in plaintext)."""
    for port in ports:
        path = _entry(port)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if data_dir is None or json.loads(path.read_text())["data_dir"] == str(data_dir.resolve()):
                path.unlink()


def find(addr: str) -> Layout | None:
    """The credentials of the `kvserve up` whose front door is `addr`, when `addr` is on this host and one
    registered them (`register`) and they are complete; else None."""
    host, _, port = addr.rpartition(":")
    if host not in LOCAL_HOSTS or not port.isdigit():
        return None
    try:
        data_dir = Path(json.loads(_entry(int(port)).read_text())["data_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    layout = Layout(data_dir)
    return layout if layout.complete() else None
