"""Python's full garbage collections, moved off the path of calls to moments without them."""

from __future__ import annotations

import gc
import logging
import sys
import sysconfig
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A full collection once this many generation-1 collections have passed, whatever the load: the bound on the
# garbage in cycles that waits (gRPC's calls leave some), about one full collection in ten seconds under a storm.
# Python's own threshold is 10.
FULL_COLLECTION_AFTER = 200


def collect_when_quiet(calls_arrived: Callable[[], int], *, every_s: float = 1.0,
                       at_most: int = FULL_COLLECTION_AFTER) -> threading.Thread | None:
    """Runs Python's full collections on a thread of the service's priority: when Python would have (its
    threshold of generation-1 collections since the last), but only after a check every `every_s` finds that no
    call came (`calls_arrived()` unchanged; a stream already open does not count), or once `at_most` have
    passed whatever the load. Generations 0 and 1 are collected as before. For CPython's generational collector
    with the GIL (3.11-3.13); elsewhere (3.14's incremental one, a free-threaded build) returns None."""
    if sys.version_info >= (3, 14) or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    gen0, gen1, gen2 = gc.get_threshold()
    # Never from allocations: Python would run it on whichever thread allocates, about every half second under a
    # storm of calls, holding the GIL while it scans every object the calls in flight hold (88-91 ms wall under
    # 600 streams), and no call would be taken or refused meanwhile.
    gc.set_threshold(gen0, gen1, 1 << 30)

    def run() -> None:
        seen = calls_arrived()
        while True:
            time.sleep(every_s)
            try:
                arrived = calls_arrived()
                pending = gc.get_count()[2]  # generation-1 collections since the last full one
                if pending >= at_most or (pending >= gen2 and arrived == seen):
                    gc.collect()
                seen = arrived
            except Exception:  # never die and leave full collections off
                log.exception("the check for a full collection failed")

    thread = threading.Thread(target=run, name="full-collections", daemon=True)
    thread.start()
    return thread
