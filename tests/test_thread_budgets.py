"""Thread budgets (docs/OPERATIONS.md, "CPU threads"): prefill and decode on one host share its cores instead
of each sizing an OpenMP team to all of them. `kvserve up`'s split adds up to the host's cores, its
service command lines carry it, a service's --threads is what torch then runs with, and on CUDA the
default is one thread."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from kvserve.host.priority import FRONT_SLICE_NS, EnginePriority
from kvserve.host.process import CUDA_THREADS, default_threads, engine_threads
from kvserve.rpc.cli import env_args
from kvserve.stack.stack import Stack, StackConfig, flag_value, thread_budgets

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("cores", "decode", "prefill"), [(1, 1, 1), (2, 1, 1), (3, 2, 1), (4, 2, 2), (16, 8, 8)])
def test_the_split_adds_up_to_the_cores_with_the_odd_one_to_decode(cores: int, decode: int, prefill: int) -> None:
    budgets = thread_budgets(cores)
    assert budgets == {"decode": decode, "prefill": prefill}
    assert sum(budgets.values()) == max(cores, 2)  # one core: one thread each, the least a service runs on


def test_a_fixed_budget_is_kept_and_the_others_take_what_is_left() -> None:
    assert thread_budgets(8, fixed={"decode": 6}) == {"decode": 6, "prefill": 2}
    assert thread_budgets(4, fixed={"prefill": 4}) == {"decode": 1, "prefill": 4}  # never below 1
    assert thread_budgets(4, ["prefill"]) == {"prefill": 4}  # decode on a GPU: prefill takes every core
    assert thread_budgets(4, []) == {}


def stack(tmp_path: Path, cores: int | None, **config: object) -> Stack:
    return Stack(StackConfig(model_dir=tmp_path, data_dir=tmp_path, cores=cores, **config))  # type: ignore[arg-type]


def threads_flags(s: Stack) -> dict[str, str | None]:
    """The --threads each compute service's command line gives it (the last one wins, as in argparse)."""
    return {"prefill": flag_value(s.prefill_spec("127.0.0.1:1").args, "--threads"),
            "decode": flag_value(s.decode_spec("127.0.0.1:1", "127.0.0.1:2").args, "--threads")}


@pytest.fixture(autouse=True)
def no_thread_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVSERVE_PREFILL_THREADS", "KVSERVE_DECODE_THREADS", "KVSERVE_PREFILL_DEVICE", "KVSERVE_DECODE_DEVICE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 16])
def test_ups_command_lines_carry_the_split(tmp_path: Path, cores: int) -> None:
    flags = threads_flags(stack(tmp_path, cores))
    assert flags == {name: str(t) for name, t in thread_budgets(cores).items()}
    assert "--threads" not in stack(tmp_path, cores).store_spec().args  # the store runs no torch kernels on CPU


def test_up_splits_the_cores_it_may_use_by_default(tmp_path: Path) -> None:
    flags = threads_flags(stack(tmp_path, cores=None))
    assert sum(int(t or 0) for t in flags.values()) == max(len(os.sched_getaffinity(0)), 2)


def test_explicit_settings_win_and_the_other_service_takes_the_rest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    s = stack(tmp_path, 8, extra_decode_args=["--threads", "6"])
    assert threads_flags(s) == {"prefill": "2", "decode": "6"}  # decode's own flag comes last
    assert s.decode_spec("a:1", "b:2").args.count("--threads") == 1
    monkeypatch.setenv("KVSERVE_PREFILL_THREADS", "5")  # the variable reaches prefill: up gives no flag
    assert threads_flags(stack(tmp_path, 8)) == {"prefill": None, "decode": "3"}


def test_a_service_on_cuda_gets_no_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = ["--device", "cuda"]
    assert threads_flags(stack(tmp_path, 8, extra_prefill_args=cuda, extra_decode_args=cuda)) == {
        "prefill": None, "decode": None}
    assert threads_flags(stack(tmp_path, 8, extra_decode_args=cuda)) == {"prefill": "8", "decode": None}
    monkeypatch.setenv("KVSERVE_PREFILL_DEVICE", "cuda:0")
    assert threads_flags(stack(tmp_path, 8)) == {"prefill": None, "decode": "8"}


def test_the_default_is_every_usable_core_on_cpu_and_one_thread_on_cuda() -> None:
    assert default_threads("cpu", 2) == 2 and default_threads("cpu", 64) == 64
    assert default_threads("cuda", 64) == default_threads("cuda:1", 2) == CUDA_THREADS == 1
    args = argparse.Namespace(threads=None, device="cuda")
    assert engine_threads(args) == 1
    assert engine_threads(argparse.Namespace(threads=3, device="cuda")) == 3  # a flag wins on any device
    assert engine_threads(argparse.Namespace(threads=None, device="cpu")) == len(os.sched_getaffinity(0))


def test_the_flag_is_readable_from_its_variable_and_must_be_positive() -> None:
    from prefill_service.__main__ import parser

    p = parser()
    assert p.parse_args(env_args(p, "prefill", {"KVSERVE_PREFILL_MODEL": "m", "KVSERVE_PREFILL_THREADS": "3"})).threads == 3
    assert p.parse_args(["--model", "m", "--threads", "0"]).threads == 0  # 0: the default (an unset request)
    assert engine_threads(argparse.Namespace(threads=0, device="cuda")) == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--threads", "-1"])


PREPARE = """
import sys
import torch
from {module}.__main__ import parser
from kvserve.host.process import prepare_engine_process
from kvserve.rpc.cli import configure_logging
args = parser().parse_args(["--model", "m", *sys.argv[1:]])
configure_logging("test", "INFO")
prepare_engine_process(args)
print(torch.get_num_threads(), torch.get_num_interop_threads())
"""


def prepared_threads(module: str, *flags: str, cores: set[int] | None = None) -> tuple[list[int], str]:
    """torch's intra-op and inter-op threads in a process that parsed `flags` with the service's parser and
    called prepare_engine_process with them, as the service does before it starts any thread; and its log."""
    code = PREPARE.format(module=module)
    if cores is not None:  # in the child itself, before torch starts a thread (a preexec_fn could hang it: gRPC)
        code = f"import os; os.sched_setaffinity(0, {sorted(cores)!r})\n{code}"
    done = subprocess.run([sys.executable, "-c", code, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [int(n) for n in done.stdout.split()], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_a_service_given_threads_1_runs_torch_on_one_thread(module: str) -> None:
    threads, log = prepared_threads(module, "--threads", "1")
    assert threads == [1, 1]
    assert "compute threads: 1 (--threads;" in log  # one line at start


@pytest.mark.slow
def test_without_the_flag_a_service_takes_the_cores_it_may_use() -> None:
    threads, log = prepared_threads("prefill_service", cores={0})
    assert threads == [1, 1]  # torch alone sizes its team to the machine's cores, not to the affinity mask
    assert "compute threads: 1 (default for --device cpu; 1 cores usable" in log


@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_each_service_hands_its_flags_to_prepare_engine_process(module: str) -> None:
    source = (ROOT / module / "__main__.py").read_text()
    assert "prepare_engine_process(args)" in source
    assert source.index("prepare_engine_process(args)") < source.index("load_model(")  # before any oneDNN kernel


KERNEL_CACHE = """
import ctypes
import os
import torch
import decode_service.__main__  # what the service imports before it prepares the process: no oneDNN kernel yet
from kvserve.host.process import prepare_engine_process
prepare_engine_process(0)

class MallInfo(ctypes.Structure):  # glibc's mallinfo2: bytes handed out from the heaps, and in mmapped chunks
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(512, 512))
x = torch.randn(600, 512)
grew = []
for rows in range(1, 601):  # a kernel compiled for each row count, as varying batches make them
    if rows in (1, 301):
        start = in_use()
    torch.ops.mkldnn._linear_pointwise(x[:rows], weight, None, "none", [], "")
    if rows in (300, 600):
        grew.append((in_use() - start) >> 20)
print(os.environ["LRU_CACHE_CAPACITY"], *grew)
"""
CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_mallinfo2(), reason="reads glibc's malloc counters (mallinfo2, glibc 2.33+)")
def test_an_engine_process_bounds_the_kernels_onednn_keeps() -> None:
    """A step's row count varies with its batch, and oneDNN compiles and keeps a kernel for each: by default
    up to 1024 of them (420 MiB for a llama's four layer shapes), which a decode service's memory grew by,
    storm after storm. prepare_engine_process caps the caches, unless the environment sets them: the memory
    the kernels hold stops growing once the cap is reached."""
    import torch

    from kvserve.engine.packed_linear import can_pack
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN linear kernels")

    def run(**env: str) -> tuple[str, int, int]:
        done = subprocess.run([sys.executable, "-c", KERNEL_CACHE], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**{k: v for k, v in os.environ.items() if k not in CACHES}, **env})
        assert done.returncode == 0, done.stderr
        capacity, first, second = done.stdout.split()
        return capacity, int(first), int(second)  # MiB grown over row counts 1-300, and over 301-600

    capacity, first, second = run(ONEDNN_PRIMITIVE_CACHE_CAPACITY="")  # empty: unset, as oneDNN reads it
    assert capacity == "256" and first > 4 * max(second, 1), (first, second)  # full at 256: it levels off
    _, first_1024, second_1024 = run(**dict.fromkeys(CACHES[:2], "1024"))
    assert second_1024 > 2 * max(second, 1), (second_1024, second)  # oneDNN's default: it goes on growing
    assert run(**dict.fromkeys(CACHES[:2], "32"))[0] == "32"  # the environment's cap wins


# -- the deployment files ----------------------------------------------------------------------------------

def compose_env(path: Path, service: str) -> dict[str, str]:
    """A compose service's variables, each ${NAME:-default} at its default (no shell, no .env)."""
    env = yaml.safe_load(path.read_text())["services"][service]["environment"]
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def test_compose_gives_prefill_and_decode_shares_of_one_host() -> None:
    threads = {s: int(compose_env(ROOT / "docker-compose.yml", s)[f"KVSERVE_{s.upper()}_THREADS"])
               for s in ("prefill", "decode")}
    assert threads == thread_budgets(2)  # the default host: 2 cores, split as `kvserve up` splits them
    for s in ("prefill", "decode"):  # on the GPU, the CUDA default (an empty variable leaves the flag unset)
        assert compose_env(ROOT / "docker-compose.gpu.yml", s)[f"KVSERVE_{s.upper()}_THREADS"] == ""


def test_kubernetes_pods_take_their_cpu_request_as_their_budget() -> None:
    for s in ("prefill", "decode"):
        deployment = next(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "base" / f"{s}.yaml").read_text()))
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env[f"KVSERVE_{s.upper()}_THREADS"]["valueFrom"] == {
            "resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}
        assert "cpu" in container["resources"]["requests"]
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (its kustomize builds the GPU overlay)")
    built = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "kubernetes" / "overlays" / "production")],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "_THREADS" not in built  # on a GPU, the CUDA default


def test_ups_compute_services_share_one_folder_of_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Services given budgets by the split lend each other their idle cores (host.cores); one given its own
    budget, or on CUDA, does not take part."""
    s = stack(tmp_path, 2)
    shares = {flag_value(s.prefill_spec("a:1").args, "--share-cores"),
              flag_value(s.decode_spec("a:1", "b:2").args, "--share-cores")}
    assert shares == {str(tmp_path / "cores")}
    assert flag_value(stack(tmp_path, 8, extra_decode_args=["--threads", "6"]).prefill_spec("a:1").args,
                      "--share-cores") is None
    assert flag_value(stack(tmp_path, 8, extra_decode_args=["--device", "cuda"]).prefill_spec("a:1").args,
                      "--share-cores") is None
    assert flag_value(stack(tmp_path, 1).decode_spec("a:1", "b:2").args, "--share-cores") is None  # 1 + 1 already


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


LINUX_NICE = pytest.mark.skipif(sys.platform != "linux" or not os.path.isdir("/proc/self/task")
                                or os.getpriority(os.PRIO_PROCESS, 0) > 9,
                                reason="nice is per thread on Linux only, and this process must have room below it")


def _slice(tid: int) -> int | None:
    """Thread `tid`'s scheduler slice in ns (sched_getattr's runtime, x86_64); None where it cannot be read (the
    thread has ended)."""
    import ctypes
    import struct

    out = ctypes.create_string_buffer(56)
    if ctypes.CDLL(None, use_errno=True).syscall(315, tid, out, 56, 0) != 0:
        return None
    return int(struct.unpack("IIQiIQQQII", out.raw)[5])


@LINUX_NICE
def test_the_engine_runs_at_the_services_priority_and_the_front_above_it() -> None:
    """On a thread standing for a service's main thread: EnginePriority raises it (where this process may) and gives
    it the shortest slice, which the threads it starts later inherit (the front); the threads started while
    `starting()` is open, the thread that runs the engine's loop and what that one starts run at the service's
    priority plus --engine-nice, with the default slice."""
    seen: dict[str, tuple[int, int]] = {}

    def mark(name: str) -> None:
        tid = threading.get_native_id()
        seen[name] = (_nice(tid), _slice(tid))

    def service_main() -> None:
        mark("before")
        priority = EnginePriority(3, front_raise=2)
        stop = threading.Event()
        with priority.starting():
            worker = threading.Thread(target=lambda: (stop.wait(30), mark("worker")))
            worker.start()
        front = threading.Thread(target=lambda: mark("front"))
        front.start()
        front.join(30)

        def loop() -> None:
            mark("loop")
            child = threading.Thread(target=lambda: mark("started by it"))
            child.start()
            child.join(30)

        try:
            priority.run(loop)()
        finally:
            stop.set()
            worker.join(30)
        seen["expected"] = (priority.front, priority.engine)

    main = threading.Thread(target=service_main)
    main.start()
    main.join(60)
    base, default_slice = seen["before"]
    front, engine = seen["expected"]
    assert engine == min(19, base + 3)
    assert front in (base, max(-20, base - 2))  # raised where this process may (root, CAP_SYS_NICE)
    assert seen["front"][0] == front and seen["front"][1] in (FRONT_SLICE_NS, default_slice)
    for name in ("worker", "loop", "started by it"):
        assert seen[name] == (engine, default_slice), (name, seen)


@pytest.mark.slow
@LINUX_NICE
def test_a_services_compute_runs_below_the_threads_that_take_calls(tmp_path: Path) -> None:
    """A decode service on 2 threads computes a prompt: the threads that did (its engine's loop and torch's OpenMP
    worker, which loading the model started) run at the service's priority plus --engine-nice; gRPC's threads,
    which take calls and refuse them, run above them (raised where this process may, else with a shorter slice)."""
    from client import Client
    from kvserve.stack.stack import start_service, stop_service
    from tests.stack_fixtures import model_dir

    decode = start_service("decode", "decode_service", [
        "--model", str(model_dir("llama")), "--listen", "127.0.0.1:0", "--insecure", "--threads", "2",
        "--kvstore", "127.0.0.1:1", "--prefill", "127.0.0.1:1", "--local-prefill-tokens", "4096",
        "--store-timeout-s", "0.5", "--engine-nice", "5"], tmp_path / "decode.log")
    pid = decode.process.pid
    try:
        before = _thread_cpu(pid)
        with Client(decode.addr, timeout_s=120, token="") as c:
            for k in range(4):  # enough compute to tell its threads from the others
                c.generate(token_ids=[(7 * i + k) % 250 + 3 for i in range(1500)], max_tokens=4, ignore_eos=True)
        nices: dict[int, int] = {}
        for tid in _thread_cpu(pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
                nices[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        used = {tid: cpu - before.get(tid, 0) for tid, cpu in _thread_cpu(pid).items() if tid in nices}
    finally:
        stop_service(decode)
    front = min(nices.values())
    assert max(used.values()) >= 8, used  # enough compute (in 10 ms ticks) to tell its threads from the others
    # The threads that computed most (the engine's loop, the main thread; the OpenMP worker, which gets less of a
    # core where other work takes the host's) run at the engine's priority, and so do at least those two.
    computed = [tid for tid, cpu in used.items() if cpu >= max(used.values()) / 4]
    service = _nice(threading.get_native_id())  # the process's priority, which decode's inherits
    engine = [tid for tid, n in nices.items() if n == service + 5]
    assert pid in computed and set(computed) <= set(engine) and len(engine) >= 2, (used, nices)
    # gRPC's threads: its event engine's, its completion-queue thread, the workers
    assert front in (service, max(-20, service - 10)), nices
    assert sum(1 for n in nices.values() if n == front) >= 4, nices
    assert all(_slice(tid) != FRONT_SLICE_NS for tid in computed), used


def _thread_cpu(pid: int) -> dict[int, int]:
    """Each thread's CPU time so far, in clock ticks."""
    cpu = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
            cpu[int(tid)] = int(fields[11]) + int(fields[12])
    return cpu
