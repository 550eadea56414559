"""The engine's C kernels (kvserve/engine/native.c): decode rows' and prompt chunks' attention that read the paged KV
cache in place, the linear layers' product over weights packed in panels, RMSNorm, rotary with the KV write, and a
copy that checks the values it moves for NaN and infinities. Loaded from the first place that has them:

1. prebuilt by ``kvserve build-kernels`` (``make setup``; the image's build stage, which has the compiler its final
   stage lacks) into kernel_dir(): ``$KVSERVE_KERNEL_DIR``, else ``<sys.prefix>/share/kvserve/kernels``. One build
   per portable target (x86-64-v4, x86-64-v3), named by a hash of the source; the best one this CPU runs loads;
2. built with the host's C compiler (``$CC``, else ``cc``) for this CPU (-march=native) when an engine first needs
   them, and kept, by a hash of everything that went into the build, in a folder of this user's alone:
   ``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``.

Neither (none prebuilt for this CPU, no compiler): all are None: the engine gathers each decode row's and prompt
chunk's blocks for SDPA, runs its linear layers through oneDNN, and checks a fetched block's values in a pass of their own: the same
tokens, a slower step and fetch. ``KVSERVE_NATIVE_ATTENTION=0`` turns off the attention alone,
``KVSERVE_NATIVE_LINEAR=0`` the product alone. attention_kernel() says which runs and why; the
engines' metrics show it, and `kvserve stats` prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# OpenMP: torch's own runtime, already loaded (libgomp.so.1), runs the kernel's loop on the threads torch computes on.
# On x86 the loops gcc vectorizes itself go in 512-bit vectors where the target has them, as the explicit ones do
# (it tunes Zen 4 and most AVX-512 CPUs for 256): one row's decode attention over 2,000 tokens, 30 layers of
# SmolLM2, took 5.6-6.0 ms with 256-bit loops and 4.7-5.4 with 512 alone (three A/B runs), 6.8 and 6.3-6.5 in a step.
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-ffp-contract=fast",
         *(("-mprefer-vector-width=512",) if platform.machine() == "x86_64" else ()))
BUILD_TIMEOUT_S = 120
SDPA = "sdpa"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write (computing in float32)
MARCH_NATIVE = "native-march-native"


@dataclass(frozen=True, slots=True)
class Target:
    """A portable -march a kernel is prebuilt for, and the /proc/cpuinfo flags a CPU needs to run it."""

    march: str
    needs: frozenset[str]


# x86-64-v3 (with v2's), as /proc/cpuinfo names them; abm is LZCNT
_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
                 "abm", "movbe", "xsave"})
# Best first, for each machine: the first one whose flags a CPU has is loaded.
TARGETS = {
    "x86_64": (Target("x86-64-v4", _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
               Target("x86-64-v3", _V3)),
    "aarch64": (Target("armv8-a", frozenset()),),
}


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """The decode attention an engine runs: ``native-<march>`` (the C kernel prebuilt for a portable target),
    native-march-native (built here for this CPU) or sdpa (the slower fallback; ``reason`` says why)."""

    name: str
    reason: str = ""


DecodeKernel = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float],
                        tuple[torch.Tensor, torch.Tensor]]
CopyFinite = Callable[[memoryview, memoryview], bool]
PANEL = 32  # output features per panel of a packed weight (native.c's PANEL)
# The exponent bits of each float type: a value with all of them set is a NaN or an infinity.
_EXPONENTS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
              torch.float64: 0x7FF0000000000000}


def cache_dir() -> Path:
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve"


def kernel_dir() -> Path:
    """Where this install looks for prebuilt kernels (and `kvserve build-kernels` puts them)."""
    return Path(os.environ.get("KVSERVE_KERNEL_DIR") or Path(sys.prefix) / "share" / "kvserve" / "kernels")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo names them (avx2, avx512f, ...)."""
    return frozenset(_cpuinfo_flags().partition(":")[2].split())


def _cpuinfo_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _private(folder: Path) -> bool:
    """Whether ``folder`` is ours alone: a library loaded from a folder others can write to runs their code."""
    st = folder.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _trusted(path: Path) -> bool:
    """Whether only root or this user can change ``path`` (a prebuilt kernel, or its folder)."""
    st = path.stat()
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compile(compiler: str, flags: Sequence[str], lib: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
        os.chmod(tmp, 0o755)  # readable by the services' user where root built it (the image)
        os.replace(tmp, lib)  # whole or not at all, whoever builds it at the same time
    finally:
        Path(tmp).unlink(missing_ok=True)


def build(compiler: str) -> Path:
    """The kernel built for this host by `compiler`, in cache_dir(): found there when built before."""
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    binary = os.stat(os.path.realpath(path))  # the compiler itself, without running it at every start
    compiler_id = f"{os.path.realpath(path)} {binary.st_size} {binary.st_mtime_ns}"
    flags = (*FLAGS, "-march=native")  # for this host's CPU: its flags are part of the hash
    digest = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), compiler_id.encode(),
                                        _cpuinfo_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):
        raise RuntimeError(f"{folder} is not private to this user (owner or permissions); set KVSERVE_CACHE_DIR")
    lib = folder / f"native-{digest}.so"
    if not lib.exists():
        _compile(compiler, flags, lib)
    return lib


def _target_flags(target: Target) -> tuple[str, ...]:
    return (*FLAGS, f"-march={target.march}")


def prebuilt_name(target: Target) -> str:
    """The file a kernel prebuilt for `target` from this source has: another source's is never loaded."""
    digest = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(_target_flags(target)).encode()]))
    return f"native-{target.march}-{digest.hexdigest()[:16]}.so"


def build_targets(folder: Path, compiler: str = "cc") -> list[Path]:
    """The kernels built by `compiler` into `folder` for every portable target of this machine's architecture,
    best first; older builds of those targets there are removed."""
    targets = TARGETS.get(platform.machine())
    if not targets:
        raise RuntimeError(f"no portable target for {platform.machine()}: engines build for their CPU on first use")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not _trusted(folder):
        raise RuntimeError(f"{folder} can be written by others than root and this user: engines would not load it")
    libs = []
    for target in targets:
        lib = folder / prebuilt_name(target)
        _compile(compiler, _target_flags(target), lib)
        for old in folder.glob(f"native-{target.march}-*.so"):
            if old != lib:
                old.unlink()
        libs.append(lib)
    return libs


def prebuilt(folder: Path, cpu: frozenset[str] | None = None) -> Path | str:
    """The best kernel prebuilt in `folder` that a CPU with the `cpu` flags (default: this one's) runs, or why
    there is none."""
    targets = [t for t in TARGETS.get(platform.machine(), ()) if (folder / prebuilt_name(t)).is_file()]
    if not targets:
        return f"none prebuilt for this source in {folder} (`kvserve build-kernels` builds them)"
    cpu = cpu_flags() if cpu is None else cpu
    fits = [t for t in targets if t.needs <= cpu]
    if not fits:
        least = targets[-1]
        return f"this CPU lacks {' '.join(sorted(least.needs - cpu))}, which {least.march}, the least prebuilt, needs"
    lib = folder / prebuilt_name(fits[0])
    if not (_trusted(folder) and _trusted(lib)):
        return f"{lib} or its folder can be written by others than root and this user"
    return lib


def load(folder: Path, compiler: str | None, cpu: frozenset[str] | None = None,
         ) -> tuple[ctypes.CDLL | None, AttentionKernel]:
    """The kernels prebuilt in `folder` for this CPU, else built by `compiler` for it (None: not built), and
    which they are; else None and why."""
    found = prebuilt(folder, cpu)
    if isinstance(found, Path):
        try:
            return ctypes.CDLL(str(found)), AttentionKernel(_kernel_name(found))
        except OSError as e:
            found = f"{found} does not load: {e}"
    if compiler is None:
        return None, AttentionKernel(SDPA, found)
    try:
        return ctypes.CDLL(str(build(compiler))), AttentionKernel(MARCH_NATIVE)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        return None, AttentionKernel(SDPA, f"{found}; and none built here: {detail}")


def _kernel_name(lib: Path) -> str:
    return lib.name.rsplit("-", 1)[0]  # native-<march>, without the source's hash


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, AttentionKernel]:
    """This process's kernels (None where there are none: said once, in the log) and which they are."""
    lib, kernel = load(kernel_dir(), os.environ.get("CC") or "cc")
    if lib is None:
        log.warning("no C kernels for the engine (%s): decode gathers each row's KV for SDPA, and a fetched block's "
                    "values are checked in a pass of their own", kernel.reason)
    return lib, kernel


def attention_kernel(device: str = "cpu", dtype: torch.dtype = torch.float32) -> AttentionKernel:
    """The decode attention of an engine whose KV cache is on `device` (a torch device type) in `dtype`."""
    if device != "cpu":
        return AttentionKernel(SDPA, f"the KV cache is on {device}: the C kernel reads host memory")
    if dtype not in KERNEL_DTYPES:
        return AttentionKernel(SDPA, f"the KV cache is {str(dtype).removeprefix('torch.')}: the C kernel reads float32 "
                               "and bfloat16")
    if os.environ.get("KVSERVE_NATIVE_ATTENTION", "1") == "0":
        return AttentionKernel(SDPA, "turned off (KVSERVE_NATIVE_ATTENTION=0)")
    return _library()[1]


@functools.cache
def copy_finite(dtype: torch.dtype) -> CopyFinite | None:
    """A copy of bytes holding ``dtype`` values, ``copy(dest, src)`` (``dest`` writable, at least as long), that
    says whether every value it moved is finite; None for another dtype, or where the kernels cannot be built."""
    lib = _library()[0]
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
    """The in-place decode attention, or None where there is none here or it is turned off."""
    lib = _library()[0]
    if lib is None or os.environ.get("KVSERVE_NATIVE_ATTENTION", "1") == "0":
        return None
    return decode_attention(lib)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _function(name: str, argtypes: list[type], restype: type | None = ctypes.c_int) -> Callable[..., int] | None:
    """This process's kernel ``name`` with its C signature, or None where there are no kernels."""
    lib = _library()[0]
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def _linear_fn() -> Callable[..., int] | None:
    return _function("kvserve_linear", [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64])


HUGE_PAGE = 2 << 20
PANEL_MAPPING_BYTES = 64 << 20


class _PanelMemory:
    """Where PanelLinear puts its panels: anonymous memory asked to be backed by 2 MiB pages (transparent huge
    pages, which Linux gives a region that asks for them where /sys/kernel/mm/transparent_hugepage/enabled says
    `madvise`, its usual default; elsewhere the same memory in 4 KiB pages). A decode step streams every weight
    once, and on 4 KiB pages it misses the TLB every 4 KiB: SmolLM2's products for one row took 20.3-22.8 ms
    (medians of three runs) on 4 KiB pages, 11.1-18.0 ms on 2 MiB ones. Panels go one after another into
    mappings of PANEL_MAPPING_BYTES (a larger weight into one of its own); a mapping goes once no tensor in it is
    left, but for the one being filled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._used = self._end = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor of ``shape``, 64-byte aligned."""
        count = math.prod(shape)
        nbytes = -(-count * dtype.itemsize // 64) * 64
        with self._lock:
            if self._map is None or self._used + nbytes > self._end:
                self._map, self._used, self._end = self._mapping(max(PANEL_MAPPING_BYTES, nbytes))
            with warnings.catch_warnings():  # torch warns that a buffer might not be writable: this one is
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._used)
            self._used += nbytes
        return tensor.view(shape)

    @staticmethod
    def _mapping(nbytes: int) -> tuple[mmap.mmap, int, int]:
        """A mapping with ``nbytes`` from a 2 MiB boundary on, asked for huge pages: (mapping, start, end)."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
        with contextlib.suppress(AttributeError, OSError):  # no huge pages here: 4 KiB ones
            m.madvise(mmap.MADV_HUGEPAGE, start, size)
        return m, start, start + nbytes


_PANELS = _PanelMemory()
_BF16_ORDER = torch.arange(PANEL).view(2, PANEL // 2).T.reshape(-1)  # 0, 16, 1, 17, ...


class PanelLinear:
    """x -> x @ weight.T + bias over a float32 or bfloat16 CPU weight packed once into panels for the C kernel (a
    copy; ``weight`` is not kept), computed in float32 and returned in x's dtype. ``rows(ids)`` reads rows of the
    weight back from the panels, so that an embedding table tied to an output projection is held once."""

    def __init__(self, fn: Callable[..., int], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.n, self.k = weight.shape
        panels = -(-self.n // PANEL)
        with torch.no_grad():
            packed = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - self.n)).view(panels, PANEL, self.k)
            if weight.dtype == torch.bfloat16:  # features 0, 16, 1, 17, ... (native.c's product_rows)
                packed = packed[:, _BF16_ORDER]
            self.panels = _PANELS.empty((panels, self.k, PANEL), weight.dtype)
            self.panels.copy_(packed.transpose(1, 2))
            self.bias = None if bias is None else F.pad(bias.detach().float(), (0, panels * PANEL - self.n))
        assert self.panels.dtype in KERNEL_DTYPES and self.panels.device.type == "cpu"
        self._fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the packed linear layer takes float32 or bfloat16, got {x.dtype}")
        rows = x.reshape(-1, self.k).float().contiguous()
        y = rows.new_empty(rows.shape[0], self.n)
        if rows.shape[0]:
            self._fn(rows.data_ptr(), rows.shape[0], self.k, self.panels.data_ptr(), self.n,
                     None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                     self.panels.dtype == torch.bfloat16)
        y = y.view(*x.shape[:-1], self.n)
        return y if x.dtype == torch.float32 else y.to(x.dtype)  # (.to costs 1 us, 120 times a step)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids`` (any shape of long) -> [*ids.shape, k]."""
        flat = ids.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.n:
            raise IndexError(f"row ids must be in [0, {self.n})")
        at = flat % PANEL
        if self.panels.dtype == torch.bfloat16:
            at = at % 16 * 2 + at // 16
        return self.panels[flat // PANEL, :, at].reshape(*ids.shape, self.k)


def linear_kernel() -> Callable[[torch.Tensor, torch.Tensor | None], PanelLinear] | None:
    """``pack(weight, bias)``: a PanelLinear over a float32 or bfloat16 CPU weight; None where there is no kernel or
    it is turned off (KVSERVE_NATIVE_LINEAR=0)."""
    fn = _linear_fn()
    if fn is None or os.environ.get("KVSERVE_NATIVE_LINEAR", "1") == "0":
        return None
    return functools.partial(PanelLinear, fn)


@functools.cache
def rms_norm_kernel() -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor] | None:
    """``norm(x, residual, weight, eps)``: Hugging Face's RMSNorm of float32 or bfloat16 CPU rows x [rows, dim], or
    where ``residual`` is given, of residual += x (in place); None where there is no kernel."""
    args: list[type] = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR]
    f32, bf16 = _function("kvserve_rms_norm", args, None), _function("kvserve_rms_norm_bf16", args, None)
    if f32 is None or bf16 is None:
        return None
    fns = {torch.float32: f32, torch.bfloat16: bf16}

    def norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, dim = x.shape
        x = x.contiguous()
        assert x.dtype == weight.dtype and x.dtype in fns and weight.is_contiguous() and weight.numel() == dim
        assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                    and residual.is_contiguous())
        out = torch.empty_like(x)
        if rows:
            fns[x.dtype](x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), rows,
                         dim, eps, out.data_ptr())
        return out

    return norm


RopeStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor,
                      torch.Tensor], None]


@functools.cache
def rope_store_kernel() -> RopeStore | None:
    """``rope_store(qkv, cos, sin, positions, kv, layer, slot_blocks, slot_offsets)``: rotary embeddings on a step's
    queries and keys in ``qkv`` [tokens, heads + 2 * kv_heads, head_dim] (in place), and its keys and values
    written into the cache ``kv`` [blocks, layers, 2, block_size, kv_heads, head_dim] (CPU, float32 or bfloat16, as
    all of them are); cos and sin [positions, head_dim] as engine.llama builds them. None where there is no
    kernel."""
    fn = _function("kvserve_rope_store", [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                                          _I64, _I64, _PTR, _PTR, _I64])
    if fn is None:
        return None

    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   kv: torch.Tensor, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        tokens, width, head_dim = qkv.shape
        blocks, layers, _, block_size, kv_heads, _ = kv.shape
        assert qkv.is_contiguous() and kv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert qkv.dtype == kv.dtype == cos.dtype == sin.dtype and kv.dtype in KERNEL_DTYPES and cos.shape == sin.shape
        assert positions.dtype == slot_blocks.dtype == slot_offsets.dtype == torch.long
        positions, slot_blocks, slot_offsets = (t.contiguous() for t in (positions, slot_blocks, slot_offsets))
        assert positions.numel() == slot_blocks.numel() == slot_offsets.numel() == tokens
        if fn(qkv.data_ptr(), tokens, width - 2 * kv_heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
              cos.shape[0], positions.data_ptr(), kv.data_ptr(), blocks, layers, layer, block_size,
              slot_blocks.data_ptr(), slot_offsets.data_ptr(), kv.dtype == torch.bfloat16):
            raise ValueError("rope_store: a position, block or offset is outside its table or the cache")

    return rope_store


ChunkKernel = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, int, float], torch.Tensor]


@functools.cache
def chunk_kernel() -> ChunkKernel | None:
    """``attend(q, kv, layer, table, ctx, scale)``: a prompt chunk's causal attention over its context, read in
    place from the cache. q [n, heads, head_dim] (the chunk's queries, the last at position ctx - 1; head_dim a
    multiple of 16); kv the cache's tensor [blocks, layers, 2, block_size, kv_heads, head_dim], float32 or bfloat16;
    table [blocks] long, the sequence's blocks in order. Computes in float32; returns [n, heads, head_dim] float32.
    None where there is no kernel or attention's is turned off (KVSERVE_NATIVE_ATTENTION=0)."""
    fn = _function("kvserve_chunk_attention", [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
                                               _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64])
    if fn is None or os.environ.get("KVSERVE_NATIVE_ATTENTION", "1") == "0":
        return None

    def attend(q: torch.Tensor, kv: torch.Tensor, layer: int, table: torch.Tensor, ctx: int,
               scale: float) -> torch.Tensor:
        n, heads, head_dim = q.shape
        blocks, layers, _, block_size, kv_heads, _ = kv.shape
        assert kv.dtype in KERNEL_DTYPES and kv.is_contiguous()
        q = q.float()
        q = q if q.stride(2) == 1 else q.contiguous()
        assert table.dtype == torch.long and table.is_contiguous() and heads % kv_heads == 0
        out = q.new_empty(n, heads, head_dim)
        if fn(q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), blocks, table.data_ptr(), table.numel(), ctx, n,
              layers, layer, block_size, kv_heads, heads // kv_heads, head_dim, scale, out.data_ptr(),
              kv.dtype == torch.bfloat16):
            raise ValueError("chunk attention: its length, layer, head size or a block is outside the cache")
        return out

    return attend


def decode_attention(lib: ctypes.CDLL) -> DecodeKernel:
    """The decode attention of the kernels `lib` (load's)."""
    fn = lib.kvserve_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, i64]
    fn.restype = ctypes.c_int

    def attend(q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor, lens: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [rows, kv_heads, group, head_dim] (one query per head); kv the cache's tensor [blocks, layers, 2,
        block_size, kv_heads, head_dim], float32 or bfloat16; tables [rows, width] long, each row's blocks in
        order; lens [rows] long, its tokens in them. Computes in float32; returns the output like q in float32, and
        the log-sum-exp [rows, kv_heads, group]."""
        rows, kv_heads, group, head_dim = q.shape
        _, layers, _, block_size, _, _ = kv.shape
        assert kv.dtype in KERNEL_DTYPES and kv.is_contiguous()
        assert tables.dtype == lens.dtype == torch.long and tables.is_contiguous() and lens.is_contiguous()
        q = q.float().contiguous()
        out, lse = torch.empty_like(q), q.new_empty(rows, kv_heads, group)
        # the kernel checks the lengths and the blocks it would read against the cache's bounds
        rc = fn(q.data_ptr(), kv.data_ptr(), kv.shape[0], tables.data_ptr(), lens.data_ptr(), rows, tables.shape[1],
                layers, layer, block_size, kv_heads, group, head_dim, scale, out.data_ptr(), lse.data_ptr(),
                kv.dtype == torch.bfloat16)
        if rc == -2:
            raise ValueError("decode attention: a row's length or block is outside its table or the cache")
        if rc:
            raise MemoryError("decode attention: no memory for its partial results")
        return out, lse

    return attend


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvserve build-kernels",
        description="Build the engine's C kernels ahead of time for every portable target of this architecture "
                    "(x86-64-v4 and x86-64-v3 on x86-64) into DIR; an engine loads the best one its CPU runs, and "
                    "needs no compiler (`make setup` and the image's build stage run this).")
    ap.add_argument("dir", nargs="?", type=Path, default=None,
                    help=f"where to put them (default: where this install looks, {kernel_dir()}; elsewhere, "
                         "engines find them by $KVSERVE_KERNEL_DIR)")
    ap.add_argument("--cc", default=os.environ.get("CC") or "cc", help="the C compiler (default: $CC, else cc)")
    args = ap.parse_args(argv)
    folder = args.dir or kernel_dir()
    try:
        libs = build_targets(folder, args.cc)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"kvserve build-kernels: {(getattr(e, 'stderr', '') or str(e)).strip()}", file=sys.stderr)
        return 1
    print("\n".join(str(lib) for lib in libs))
    found = prebuilt(folder)
    print(f"this CPU runs {_kernel_name(found)}" if isinstance(found, Path) else f"this CPU runs none of them: {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
