"""The tiers a StoreConfig asks for, top to bottom, the remote tier under them, and the pin cap they imply."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import lmdb

from kvstore.config import StoreConfig
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import ArenaHostTier, MemoryHostTier, new_shm_dir
from kvstore.tier import TierStorage

if TYPE_CHECKING:
    from kvstore.remote_tier import RemoteTier

log = logging.getLogger(__name__)

MIN_PIN_CAP = 64 * 1024**2  # the default per-caller cap never goes below: leases must fit a long prompt


def pinned_bytes_cap(config: StoreConfig, tiers: list[tuple[TierStorage, int]]) -> int:
    """The bytes one caller's leases may pin at once: --max-pinned-bytes-per-caller, by default a quarter
    of the top tier (where writes land), at least MIN_PIN_CAP. Callers are told apart by certificate
    with mTLS, else by host; on the arena's socket (the same host) by process (arena.Connection.caller)."""
    if config.max_pinned_bytes_per_caller is not None:
        return config.max_pinned_bytes_per_caller
    return max(tiers[0][1] // 4, MIN_PIN_CAP)


def build_remote(config: StoreConfig) -> RemoteTier | None:
    if config.remote is None:
        return None
    from kvstore.remote_tier import RemoteTier  # redis only when a remote tier is on

    return RemoteTier(config.remote, record_key=config.record_key)


def build_tiers(config: StoreConfig) -> list[tuple[TierStorage, int]]:
    """The tiers top to bottom. Same-host clients reach one arena: the device tier's when it is on (the
    host tier is then a plain dict, read over gRPC), else the host tier's shared memory (with --shm)."""
    tiers: list[tuple[TierStorage, int]] = []
    device_arena = config.device != "off" and config.device_capacity > 0
    if device_arena:
        from kvstore.device_tier import DeviceArenaTier  # torch (and cupy) only when the device tier is on

        device = DeviceArenaTier(new_shm_dir(config.shm_root), config.device_capacity, config.device)
        tiers.append((device, config.device_capacity))
    if config.host_capacity > 0:
        shm = config.shm and not device_arena
        host = ArenaHostTier.create(config.host_capacity, config.shm_root) if shm else MemoryHostTier()
        tiers.append((host, config.host_capacity))
    if config.disk_capacity > 0 and config.disk_path is not None:
        try:
            disk = DiskTier(config.disk_path, config.disk_capacity, record_key=config.record_key)
            tiers.append((disk, config.disk_capacity))
        except (OSError, lmdb.Error) as exc:  # read-only, missing, full: the tier only holds cache
            log.error("disk tier at %s cannot be used (%s): serving from the memory tiers only", config.disk_path, exc)
    if not tiers:
        raise ValueError("every tier is off: give --host-capacity or --disk-capacity")
    return tiers
