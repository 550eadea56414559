"""Which decode replica a request goes to (docs/DESIGN.md, "Router"): the serving one with the lowest cost,
among equals the least recently chosen.

- `prefix`: blocks left to compute (the prompt's full blocks past the leading ones the replica holds, in its
  pool or its node's store) + `load_weight` × its sequences (running and waiting), so a prefix pulls a request
  to the replica that has it until that replica is that much busier than the others;
- `least-loaded`: its sequences;
- `round-robin`: in turn.

A replica that fails `eject_after` requests in a row is ejected from choice, as in Envoy's outlier detection,
for longer each time, and taken back once that time is over and its health check says it serves; never the
last replica serving."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Sequence

from kvserve.router.replica import Replica
from protos.block_hash import BlockHash

log = logging.getLogger(__name__)

POLICIES = ("prefix", "least-loaded", "round-robin")
# Outlier ejection, Envoy's defaults but for the count: each failure costs its caller up to the first-token
# timeout, and a busy replica that works ends some streams between its slow ones, which starts the count again.
EJECT_AFTER = 3  # failures in a row that eject a replica
EJECTION_S = 30.0  # how long its first ejection lasts; the n-th, n times that (less one per EJECTION_S served since)
MAX_EJECTION_S = 300.0


class Policy:
    """Picks among serving replicas by `name` (one of POLICIES)."""

    def __init__(self, name: str, load_weight: float) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
        self.name = name
        self.load_weight = load_weight
        self._choices = itertools.count(1)  # numbers each choice: among equals, the least recently chosen goes

    def pick(self, candidates: Sequence[Replica], hashes: Sequence[BlockHash]) -> tuple[Replica, int] | None:
        """The replica with the lowest cost and how many of the leading `hashes` it holds; None without one."""
        if not candidates:
            return None
        held = {r.addr: r.blocks.leading(hashes) for r in candidates}

        def cost(r: Replica) -> float:
            if self.name == "prefix":
                return (len(hashes) - held[r.addr]) + self.load_weight * r.load
            return r.load if self.name == "least-loaded" else 0

        best = min(candidates, key=lambda r: (cost(r), r.last_chosen))
        best.last_chosen = next(self._choices)
        return best, held[best.addr]


class Outliers:
    """Ejects a replica at `eject_after` failures in a row (0: never): `ejection_s` the first time, n times that
    the n-th, at most `max_ejection_s`; unless no other replica would be left serving: a slow answer is better
    than none."""

    def __init__(self, eject_after: int = EJECT_AFTER, ejection_s: float = EJECTION_S,
                 max_ejection_s: float = MAX_EJECTION_S) -> None:
        if eject_after < 0 or ejection_s <= 0:
            raise ValueError(f"eject_after ({eject_after}) must be at least 0, ejection_s ({ejection_s}) more than 0")
        self.eject_after = eject_after
        self.ejection_s = ejection_s
        self.max_ejection_s = max_ejection_s
        self._counts: Counter[str] = Counter()  # replica: times it was ejected
        self._lock = threading.Lock()  # one ejection at a time: never the last replica serving

    def failed(self, replica: Replica, replicas: Sequence[Replica], why: str) -> None:
        """`replica` failed a request (`why`): no first response in time, UNAVAILABLE, a stream ended without a
        result. `replicas`: all of them, to keep one serving."""
        n = replica.ejection.failed()
        if self.eject_after == 0 or n < self.eject_after:
            return
        with self._lock:
            if replica.ejection.ejected:
                return
            if not any(r.serving for r in replicas if r is not replica):
                if n == self.eject_after:
                    log.warning("decode replica %s failed %d requests in a row (the last: %s); not ejected: no "
                                "other replica serves", replica.addr, n, why)
                return
            seconds = replica.ejection.eject(self.ejection_s, self.max_ejection_s)
            self._counts[replica.addr] += 1
        log.warning("decode replica %s failed %d requests in a row (the last: %s): ejected for %.0f s, then taken "
                    "back once its health check says it serves", replica.addr, n, why, seconds)

    def ejections(self) -> dict[str, int]:
        """Replica: how many times it was ejected for failing requests in a row."""
        with self._lock:
            return dict(self._counts)
