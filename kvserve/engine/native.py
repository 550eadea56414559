"""The engine's C kernels (kvserve/engine/native.c): decode attention that reads the paged KV cache in place, and a copy
that checks the values it moves for NaN and infinities. Built with the host's C compiler when an engine first
needs them and kept, by a hash of everything that went into the build, in a folder of this user's:
``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``.

Without a compiler (a slim container image) both are None: the engine gathers each decode row's blocks for
SDPA, and checks a fetched block's values in a pass of their own: the same tokens, a slower step and fetch.
``KVSERVE_NATIVE_ATTENTION=0`` turns off the attention alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# -march=native: the build is for this host's CPU (its flags are part of the hash); OpenMP: torch's own runtime,
# already loaded (libgomp.so.1), runs the kernel's loop on the threads torch computes on.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-ffp-contract=fast")
BUILD_TIMEOUT_S = 120

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float],
                        tuple[torch.Tensor, torch.Tensor]]
CopyFinite = Callable[[memoryview, memoryview], bool]
# The exponent bits of each float type: a value with all of them set is a NaN or an infinity.
_EXPONENTS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
              torch.float64: 0x7FF0000000000000}


def cache_dir() -> Path:
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _private(folder: Path) -> bool:
    """Whether ``folder`` is ours alone: a library loaded from a folder others can write to runs their code."""
    st = folder.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def build(compiler: str) -> Path:
    """The kernel built for this host by `compiler`, in cache_dir(): found there when built before."""
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    binary = os.stat(os.path.realpath(path))  # the compiler itself, without running it at every start
    compiler_id = f"{os.path.realpath(path)} {binary.st_size} {binary.st_mtime_ns}"
    digest = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler_id.encode(),
                                        _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):
        raise RuntimeError(f"{folder} is not private to this user (owner or permissions); set KVSERVE_CACHE_DIR")
    lib = folder / f"native-{digest}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                           text=True, timeout=BUILD_TIMEOUT_S)
            os.replace(tmp, lib)  # whole or not at all, whoever builds it at the same time
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels, or None where they cannot be built here (said once, in the log)."""
    try:
        return ctypes.CDLL(str(build(os.environ.get("CC") or "cc")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the engine's C kernels (%s): decode gathers each row's KV for SDPA, and a "
                    "fetched block's values are checked in a pass of their own", detail)
        return None


@functools.cache
def copy_finite(dtype: torch.dtype) -> CopyFinite | None:
    """A copy of bytes holding ``dtype`` values, ``copy(dest, src)`` (``dest`` writable, at least as long), that
    says whether every value it moved is finite; None for another dtype, or where the kernels cannot be built."""
    lib = _library()
    exponent = _EXPONENTS.get(dtype)
    if lib is None or exponent is None:
        return None
    fn = lib.kvserve_copy_finite
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    width = dtype.itemsize

    def copy(dest: memoryview, src: memoryview) -> bool:
        if len(dest) < len(src):
            raise ValueError(f"{len(src)} bytes do not fit a buffer of {len(dest)}")
        if not src:
            return True
        # a writable buffer's address costs 0.5 us through ctypes; a read-only one (bytes) goes through numpy
        source = np.frombuffer(src, np.uint8).ctypes.data if src.readonly else _address(src)
        return fn(_address(dest), source, len(src), width, exponent) == 1

    return copy


def _address(buffer: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The in-place decode attention, or None where it cannot be built here or is turned off."""
    lib = _library()
    if lib is None or os.environ.get("KVSERVE_NATIVE_ATTENTION", "1") == "0":
        return None
    fn = lib.kvserve_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr]
    fn.restype = ctypes.c_int

    def attend(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor, lens: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [rows, kv_heads, group, head_dim] float32 (one query per head); kv the cache's tensor
        [blocks, layers, 2, block_size, kv_heads, head_dim]; tables [rows, width] long, each row's blocks in
        order; lens [rows] long, its tokens in them. Returns the output like q, and the log-sum-exp
        [rows, kv_heads, group]."""
        rows, kv_heads, group, head_dim = q.shape
        _, layers, _, block_size, _, _ = kv.shape
        assert q.dtype == kv.dtype == torch.float32 and kv.is_contiguous()
        assert tables.dtype == lens.dtype == torch.long and tables.is_contiguous() and lens.is_contiguous()
        q = q.contiguous()
        out, lse = torch.empty_like(q), q.new_empty(rows, kv_heads, group)
        # the kernel checks the lengths and the blocks it would read against the cache's bounds
        rc = fn(q.data_ptr(), kv.data_ptr(), kv.shape[0], tables.data_ptr(), lens.data_ptr(), rows, tables.shape[1],
                layers, layer, block_size, kv_heads, group, head_dim, scale, out.data_ptr(), lse.data_ptr())
        if rc == -2:
            raise ValueError("decode attention: a row's length or block is outside its table or the cache")
        if rc:
            raise MemoryError("decode attention: no memory for its partial results")
        return out, lse

    return attend
