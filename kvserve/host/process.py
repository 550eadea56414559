"""An engine process's set-up, before any thread starts: its compute thread budget, its CPU priority, oneDNN's
kernel caches, the GIL's switch interval and glibc's malloc; and, for every service, dying with its parent."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

# On CUDA the forward runs on the GPU; the CPU threads only launch its kernels and run the step's Python and
# small host copies, so a process needs no OpenMP team (vLLM likewise cuts its GPU worker processes to one
# OpenMP thread unless OMP_NUM_THREADS says otherwise).
CUDA_THREADS = 1

# 0.5 ms instead of 5. The step thread lets go of the GIL in each of a step's few hundred kernels; while another
# thread ran Python (the KV I/O threads encoding a prompt for the store), it waited up to the interval to get it
# back after each one, and one such save stalled every running stream for 300-500 ms.
_GIL_SWITCH_INTERVAL_S = 0.0005
# glibc's mallopt parameters; 32 MiB is the ceiling of glibc's own adaptive threshold on 64-bit.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BUFFER_MAX = 32 << 20
# Entries in each of oneDNN's two caches of compiled kernels (ideep's, which torch's linear layers use, and
# oneDNN's own), instead of 1024. A prepacked linear layer (engine.packed_linear) compiles a kernel of about
# 0.4 MiB for each row count, which varies with the batch: the default caches grew every engine process by up
# to 420 MiB. 256 hold about 105 MiB, 64 recent row counts for each of a llama's four layer shapes; a row count
# past them costs about 0.5 ms per shape. A kernel lives while either cache holds it: the larger cap decides.
ONEDNN_CACHE_ENTRIES = 256


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity mask; a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def default_threads(device: str, cores: int) -> int:
    """The compute thread budget of a service given no --threads: on CPU all `cores` it may use (a process
    alone on its host, as before budgets), on CUDA `CUDA_THREADS`."""
    return CUDA_THREADS if str(device).startswith("cuda") else max(1, cores)


def engine_threads(args: argparse.Namespace) -> int:
    """--threads, or (not given, or 0) its default for --device and the cores this process may use."""
    if args.threads:
        return int(args.threads)
    return default_threads(args.device, len(usable_cores()))


def prepare_engine_process(args: argparse.Namespace | int) -> None:
    """What a process that runs the engine sets from its parsed flags before any thread starts (every thread
    inherits it): its compute thread budget (--threads), its CPU priority (--nice), oneDNN's kernel caches,
    the GIL's switch interval and glibc's malloc. A bare int is the older form, --nice alone, which leaves
    torch's threads as torch sets them. Call it before the model loads: packing its weights is the process's
    first oneDNN kernel."""
    nice = args if isinstance(args, int) else int(args.nice)
    if not isinstance(args, int):
        # services that share a host's cores each take their share: two OpenMP teams sized to every core stall
        # at each other's barriers (engine.engine's docstring)
        set_thread_budget(engine_threads(args), source="--threads" if args.threads
                          else f"default for --device {args.device}")
    os.nice(nice)
    for names in (["LRU_CACHE_CAPACITY"], ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"]):
        if not any(os.environ.get(name) for name in names):  # oneDNN reads them at its first kernel; "" is unset
            os.environ[names[0]] = str(ONEDNN_CACHE_ENTRIES)
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
    if sys.platform == "linux":  # other C libraries are left as they are
        # Tensor buffers up to _HEAP_BUFFER_MAX come from the heap, and freed ones stay there for the next step.
        # By default a buffer over 128 KiB got a fresh mmap, faulted in page by page, until glibc's adaptive
        # threshold had seen that size freed: over a decode service's first 16 streams, half a million page
        # faults made each step 40 % slower.
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BUFFER_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _HEAP_BUFFER_MAX)
        except (AttributeError, OSError):
            pass


def set_thread_budget(threads: int, source: str = "--threads") -> None:
    """torch's intra-op threads to `threads` and its inter-op threads to 1 (the engine forks no torch tasks: the
    inter-op pool only adds idle threads), logged in one line. The inter-op count can be set once per process,
    before any inter-op work: a later call leaves it. Sets the threads of the torch the process has already
    loaded, as the engine services have by then: this package imports no torch."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("set_thread_budget: torch is not loaded; import the engine first")
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work has started
        torch.set_num_interop_threads(1)
    log.info("compute threads: %d (%s; %d cores usable; torch intra-op %d, inter-op %d)", threads, source,
             len(usable_cores()), torch.get_num_threads(), torch.get_num_interop_threads())


def trim_heap() -> None:
    """Gives back to the kernel what the heap holds free (glibc's malloc_trim): once the model is loaded and its
    layers packed, the buffers of the loading (about 45 MB on SmolLM2) would otherwise stay resident."""
    if sys.platform == "linux":
        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None).malloc_trim(0)


def exit_with_parent() -> None:
    """Linux: when started by `kvserve up` (or any stack.stack launcher), which names itself in
    KVSERVE_PARENT_PID, get SIGTERM as soon as that process dies, so no orphan keeps its ports;
    exit at once if it is already gone. Does nothing for a service started any other way."""
    parent = os.environ.pop("KVSERVE_PARENT_PID", "")
    if not parent.isdigit() or sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return
    if os.getppid() != int(parent):  # it died before the call
        sys.exit(f"the process that started this service ({parent}) has exited")
