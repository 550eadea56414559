"""The store's configuration and the tiers it builds, top to bottom."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.disk_tier import DiskTier
from kvstore.host_tier import ArenaHostTier, MemoryHostTier
from kvstore.tier import TierStorage

log = logging.getLogger(__name__)

_GiB = 1024**3


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

    def __post_init__(self) -> None:
        if self.device not in ("off", "cpu", "cuda"):
            raise ValueError(f"--device must be off, cpu or cuda, not {self.device!r}")
        if self.disk_capacity and self.disk_path is None:
            raise ValueError("--disk-capacity needs --disk-path")
        if min(self.host_capacity, self.disk_capacity, self.device_capacity) < 0:
            raise ValueError("capacities must be >= 0")


def build_tiers(config: StoreConfig) -> list[tuple[TierStorage, int]]:
    tiers: list[tuple[TierStorage, int]] = []
    if config.device != "off" and config.device_capacity > 0:
        from kvstore.device_tier import DeviceTier  # torch only when the device tier is on

        tiers.append((DeviceTier(config.device_capacity, config.device), config.device_capacity))
    if config.host_capacity > 0:
        host = ArenaHostTier.create(config.host_capacity, config.shm_root) if config.shm else MemoryHostTier()
        tiers.append((host, config.host_capacity))
    if config.disk_capacity > 0 and config.disk_path is not None:
        try:
            tiers.append((DiskTier(config.disk_path, config.disk_capacity), config.disk_capacity))
        except (OSError, lmdb.Error) as exc:  # read-only, missing, full: the tier only holds cache
            log.error("disk tier at %s cannot be used (%s): serving from the memory tiers only", config.disk_path, exc)
    if not tiers:
        raise ValueError("every tier is off: give --host-capacity or --disk-capacity")
    return tiers
