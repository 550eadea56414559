"""The store's configuration: its tiers' sizes and the remote tier's settings (kvstore/build.py builds them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvstore.leases import MAX_TTL_S
from kvstore.record_key import RecordKey

_MiB = 1024**2
_GiB = 1024**3
MAX_BLOCK_BYTES = 256 * _MiB  # a 16-token block of a 405B model is 8 MiB


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The shared remote tier (kvstore/remote_tier.py): Redis or Valkey at `url`, one node of a cluster
    when `cluster`."""

    url: str
    cluster: bool = False
    ttl_s: float = 86400.0  # each key's expiry
    timeout_s: float = 0.1  # of each call (connect, read, write)
    key_prefix: str = "kvserve"
    queue_bytes: int = 256 * _MiB  # blocks waiting to be written; past it the oldest are dropped
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix") or (self.cluster and scheme == "unix"):
            raise ValueError(f"--remote-url must be redis://HOST:PORT/DB or rediss://... (TLS), not {self.url!r}")
        if self.ttl_s <= 0 or self.timeout_s <= 0 or self.queue_bytes <= 0:
            raise ValueError("--remote-ttl-s, --remote-timeout-s and --remote-queue-bytes must be > 0")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ValueError(f"--remote-key-prefix must be a word without spaces, not {self.key_prefix!r}")
        if (self.tls_ca or self.tls_cert or self.tls_key) and scheme != "rediss":
            raise ValueError("--remote-tls-ca, --remote-tls-cert and --remote-tls-key need a rediss:// --remote-url")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--remote-tls-cert and --remote-tls-key go together")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Tier sizes in bytes; a capacity of 0 turns that tier off."""

    host_capacity: int = 1 * _GiB
    disk_capacity: int = 0
    disk_path: Path | None = None
    device_capacity: int = 0
    device: str = "off"  # "off" | "cpu" | "cuda"
    shm: bool = True
    shm_root: str = "/dev/shm"
    sweep_interval_s: float = 0.5
    flush_timeout_s: float = 10.0
    max_block_bytes: int = MAX_BLOCK_BYTES  # and never more than the largest tier
    max_lease_ttl_s: float = MAX_TTL_S  # a longer lease gets this much
    max_pinned_bytes_per_caller: int | None = None  # None: a quarter of the top tier, at least build.MIN_PIN_CAP
    remote: RemoteConfig | None = None  # a shared remote tier under the local ones
    record_key: RecordKey | None = None  # the MAC on the disk and remote tiers' records (None: checksum only)

    def __post_init__(self) -> None:
        if self.device not in ("off", "cpu", "cuda"):
            raise ValueError(f"--device must be off, cpu or cuda, not {self.device!r}")
        if self.disk_capacity and self.disk_path is None:
            raise ValueError("--disk-capacity needs --disk-path")
        if min(self.host_capacity, self.disk_capacity, self.device_capacity) < 0:
            raise ValueError("capacities must be >= 0")
        if self.max_block_bytes <= 0 or self.max_lease_ttl_s <= 0:
            raise ValueError("--max-block-bytes and --max-lease-ttl-s must be > 0")
        if self.max_pinned_bytes_per_caller is not None and self.max_pinned_bytes_per_caller <= 0:
            raise ValueError("--max-pinned-bytes-per-caller must be > 0")
