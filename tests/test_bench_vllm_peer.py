"""`kvserve bench multi-turn --peer vllm` (kvserve/bench/vllm_peer.py) without vLLM: its flags and thread settings, the
skipped peer when there is no venv or its server does not start (no process left behind), the session over
the OpenAI SDK against a fake server that speaks vLLM's streamed completions, once per thread setting, and the
side-by-side figures and goals on synthetic traces. No test starts vLLM: the real run is `make bench-peers`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from client.client import Result, Timings, Usage
from kvserve.bench import multi_turn, vllm_peer
from kvserve.bench.report import Progress
from kvserve.bench.sessions import Settings, random_tokens, run_session, run_session_with
from kvserve.bench.streams import StreamTrace
from tests.polling import wait_until

PEER_FLAGS = ["--peer", "vllm", "--users", "2", "--rounds", "3"]


def peer_args(tmp_path: Path, python: Path, **more: Any) -> argparse.Namespace:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"dtype": "float32"}))
    args = multi_turn.parse_args(["--peer", "vllm", "--model", str(model), "--vllm-python", str(python),
                                  "--quiet"])
    for key, value in more.items():
        setattr(args, key, value)
    return args


SMALL = Settings(users=2, rounds=3, system_tokens=40, question_tokens=8, answer_tokens=4, rate=0.0, seed=3,
                 user_tokens=5)


# ---- flags ------------------------------------------------------------------------------------


def test_the_peer_is_optional_and_has_its_defaults() -> None:
    plain = multi_turn.parse_args([])
    assert plain.peer is None
    args = multi_turn.parse_args(PEER_FLAGS)
    assert args.peer == "vllm"
    assert args.vllm_python == Path(".venv-vllm/bin/python")
    assert args.vllm_kv_space == 4 and args.vllm_start_timeout == 600
    args = multi_turn.parse_args([*PEER_FLAGS, "--vllm-python", "/opt/v/bin/python", "--vllm-kv-space", "2",
                                  "--vllm-start-timeout", "30"])
    assert (args.vllm_python, args.vllm_kv_space, args.vllm_start_timeout) == (Path("/opt/v/bin/python"), 2, 30)


@pytest.mark.parametrize("extra", [["--addr", "127.0.0.1:1"], ["--replicas", "2"], ["--vllm-kv-space", "0"],
                                   ["--peer", "sglang"]])
def test_the_peer_refuses_what_it_cannot_compare(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        multi_turn.parse_args([*PEER_FLAGS, *extra])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err


def test_the_server_gets_the_models_dtype_a_bounded_kv_space_and_stays_offline(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert vllm_peer.model_dtype(model) == "bfloat16"
    assert vllm_peer.model_dtype(tmp_path) == "auto"  # no config
    cmd = vllm_peer.vllm_command(Path("v/bin/python"), model, 8123, "bfloat16")
    assert cmd[:3] == ["v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--enable-prompt-tokens-details", "127.0.0.1", "8123"} <= set(cmd)
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--model") + 1] == str(model)
    default, every = vllm_peer.thread_settings([0, 1, 2, 3])
    caller = {"PATH": "/usr/bin", "VIRTUAL_ENV": "/x/.venv", "VLLM_CPU_OMP_THREADS_BIND": "1",
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMP_NUM_THREADS": "3"}
    env = vllm_peer.vllm_env(Path("v/bin/python"), 3, default, caller)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["PATH"].split(os.pathsep) == ["v/bin", "/usr/bin"] and "VIRTUAL_ENV" not in env
    # vLLM's default: the caller's thread variables are not passed on; every core: bound, none reserved.
    assert not set(vllm_peer.THREAD_VARS) & set(env) and env["OMP_NUM_THREADS"] == "3"
    env = vllm_peer.vllm_env(Path("v/bin/python"), 3, every, caller)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == ("0-3", "0")


def test_the_thread_settings_are_vllms_default_and_every_core_bound() -> None:
    default, every = vllm_peer.thread_settings([1, 0])
    assert (default.name, dict(default.env)) == ("default", {})
    assert (every.name, dict(every.env)) == ("all-cores", {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert vllm_peer.thread_settings([0, 2, 3])[1].env["VLLM_CPU_OMP_THREADS_BIND"] == "0,2,3"
    cores = sorted(os.sched_getaffinity(0))  # by default, the cores this process may run on
    assert vllm_peer.thread_settings()[1].env["VLLM_CPU_OMP_THREADS_BIND"] == \
        vllm_peer.thread_settings(cores)[1].env["VLLM_CPU_OMP_THREADS_BIND"]
    assert every.describe() == "every core bound (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0)"
    assert "default" in default.describe()


# ---- skipped ----------------------------------------------------------------------------------


def test_without_the_venv_the_peer_is_skipped_with_how_to_install_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    progress = Progress(100, quiet=True)
    peer, runs = vllm_peer.run_vllm(peer_args(tmp_path, missing), [SMALL], progress)
    assert runs == {} and peer["threads"] == [] and "faster" not in peer
    assert progress.done == vllm_peer.progress_steps([SMALL])  # the bar goes on past the peer's part
    assert peer["skipped"].startswith(f"no vLLM: {missing} is missing")
    assert "`make bench-peers` installs it" in peer["skipped"]
    text = vllm_peer.comparison_text(peer, {})
    assert text == f"vs vLLM: skipped: {peer['skipped']}"
    assert vllm_peer.comparison_panels(peer) == []


def test_a_python_without_vllm_is_skipped_too(tmp_path: Path) -> None:
    with pytest.raises(vllm_peer.PeerSkipped, match=r"no vLLM in .*\(vllm is not installed there\).*make bench-peers"):
        vllm_peer.vllm_version(Path(sys.executable))  # the project's venv: no vllm


def fake_python(tmp_path: Path, body: str) -> Path:
    """An executable named python whose `-c` answers a version and whose `-m` prints its thread variables and
    runs `body` (Python; `all_cores` says which setting it runs under)."""
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import os, sys
        if sys.argv[1] == "-c":
            print("0.0-fake")
            raise SystemExit(0)
        args = sys.argv[3:]
        port = int(args[args.index("--port") + 1])
        print("threads:", *(os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")),
              flush=True)
        all_cores = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") == "0"
        """) + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.mark.slow
def test_a_server_that_dies_is_skipped_with_its_log(tmp_path: Path) -> None:
    python = fake_python(tmp_path, """\
        print("RuntimeError: no CPU attention backend for head size 7", flush=True)
        raise SystemExit(3)
        """)
    peer, runs = vllm_peer.run_vllm(peer_args(tmp_path, python), [SMALL], Progress(1, quiet=True))
    assert runs == {} and "faster" not in peer
    assert peer["version"] == "0.0-fake"
    assert [t["name"] for t in peer["threads"]] == ["default", "all-cores"]
    assert all("vLLM's server exited (3) before it was ready" in t["skipped"] for t in peer["threads"])
    assert peer["skipped"].startswith("default: vLLM's server exited (3)") and "; all-cores: vLLM's" in peer["skipped"]
    assert "no CPU attention backend for head size 7" in peer["skipped"]


@pytest.mark.slow
def test_a_server_never_ready_is_stopped_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    python = fake_python(tmp_path, f"""\
        import subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        open({str(pids)!r}, "w").write(str(child.pid))
        print("loading the model ...", flush=True)
        time.sleep(60)
        """)
    log = tmp_path / "vllm.log"
    with pytest.raises(vllm_peer.PeerSkipped, match=r"not ready in 1 s \(--vllm-start-timeout\)(.|\n)*loading the model"), \
            vllm_peer.vllm_server(python, tmp_path, kv_space_gib=1, threads=vllm_peer.thread_settings()[0],
                                  start_timeout_s=1, log_path=log):
        pass
    child = int(pids.read_text())

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, timeout_s=10, message="the server's child outlived it")


def test_signals_raise_system_exit_only_while_the_server_runs() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc, vllm_peer.exit_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


# ---- the session over the OpenAI SDK, against a fake server -----------------------------------

FAKE_SERVER = """\
    import json, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["stream"] and body["ignore_eos"], body
            assert body["return_token_ids"] and body["temperature"] == 0 and body["model"] == "kvserve-peer"
            prompt = body["prompt"]
            cached = max((n for n in (sum(1 for _ in zip(p, prompt)) for p in seen)), default=0)
            seen.append(prompt)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            def event(d):
                self.wfile.write(b"data: " + json.dumps(d).encode() + b"\\n\\n")
                self.wfile.flush()
            head = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"]}
            n = body["max_tokens"]
            for i in range(n):
                time.sleep(0 if all_cores else 0.02)  # the default setting is the slower
                token = (sum(prompt) + i) % 256
                event({**head, "choices": [{"index": 0, "text": chr(65 + token % 26), "logprobs": None,
                       "finish_reason": "length" if i == n - 1 else None, "token_ids": [token]}]})
            event({**head, "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                   "total_tokens": len(prompt) + n, "prompt_tokens_details": {"cached_tokens": cached}}})
            self.wfile.write(b"data: [DONE]\\n\\n")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """


def test_the_session_runs_over_the_openai_sdk_with_the_same_token_ids(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "5")  # not passed on to either setting
    python = fake_python(tmp_path, FAKE_SERVER)
    # two sessions on each server (bench scaling's): the second, of other token ids, after the first
    other = dataclasses.replace(SMALL, users=1, seed=4)
    progress = Progress(100, quiet=True)
    peer, runs = vllm_peer.run_vllm(peer_args(tmp_path, python, log_dir=tmp_path / "logs"), [SMALL, other],
                                    progress)
    assert progress.done == vllm_peer.progress_steps([SMALL, other]) == 2 * (2 + 6 + 3)
    # Each thread setting on a server of its own, with its variables; the faster is the higher output tok/s.
    assert set(runs) == {"default", "all-cores"}, peer
    bind = vllm_peer.thread_settings()[1].env["VLLM_CPU_OMP_THREADS_BIND"]
    assert "threads: None None" in (tmp_path / "logs" / "vllm-default.log").read_text()
    assert f"threads: {bind} 0" in (tmp_path / "logs" / "vllm-all-cores.log").read_text()
    default, every = peer["threads"]
    assert (default["name"], default["env"], every["name"]) == ("default", {}, "all-cores")
    assert every["env"] == {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    for setting in peer["threads"]:
        assert setting["startup_s"] > 0 and setting["ttft_p50_rounds_2_plus_s"] > 0
        assert setting["throughput_tok_s"] == pytest.approx(vllm_peer.setting_figures(runs[setting["name"]])
                                                            ["throughput_tok_s"])
    assert every["throughput_tok_s"] > default["throughput_tok_s"] and peer["faster"] == "all-cores"
    assert vllm_peer.faster(peer) is every
    assert [[t.token_ids for u in s for t in u] for s in runs["default"]] == \
        [[t.token_ids for u in s for t in u] for s in runs["all-cores"]]
    traces, (alone,) = runs["all-cores"]
    assert [len(t.token_ids) for t in alone] == [SMALL.answer_tokens] * SMALL.rounds
    assert alone[0].result is not None and list(alone[0].result.prompt_token_ids)[:SMALL.system_tokens] == \
        random_tokens(random.Random(other.seed), SMALL.system_tokens)
    assert peer["version"] == "0.0-fake" and peer["dtype"] == "float32"
    assert len(traces) == SMALL.users and all(len(u) == SMALL.rounds for u in traces)
    # The prompts the stack would get: each round the history (answers included) and a new question.
    system = random_tokens(random.Random(SMALL.seed), SMALL.system_tokens)
    for user in traces:
        for r, t in enumerate(user):
            assert t.result is not None
            prompt = list(t.result.prompt_token_ids)
            assert len(prompt) == SMALL.prompt_tokens(r + 1) and prompt[:SMALL.system_tokens] == system
            assert t.token_ids == [(sum(prompt) + i) % 256 for i in range(SMALL.answer_tokens)]
            assert len(t.arrivals) == SMALL.answer_tokens and t.ttft_s > 0 and t.end >= t.arrivals[-1]
            if r:
                before = user[r - 1].result
                assert before is not None
                assert prompt[:len(before.prompt_token_ids) + SMALL.answer_tokens] == \
                    [*before.prompt_token_ids, *user[r - 1].token_ids]
                assert t.usage.cached_tokens >= len(before.prompt_token_ids)
    # The same session over kvserve's client sends the very same prompts.
    sent: list[list[int]] = []

    def record(prompt: list[int], max_tokens: int, start_at: float | None) -> StreamTrace:
        sent.append(prompt)
        return trace(0.0, [0.1 * (i + 1) for i in range(max_tokens)], prompt_tokens=len(prompt),
                     token_ids=[(sum(prompt) + i) % 256 for i in range(max_tokens)])

    run_session_with(record, SMALL, Progress(1, quiet=True))
    assert sorted(sent) == sorted(list(t.result.prompt_token_ids) for u in traces for t in u if t.result)


@pytest.mark.slow
def test_a_setting_whose_server_dies_is_reported_and_the_other_compared(tmp_path: Path) -> None:
    python = fake_python(tmp_path, textwrap.dedent("""\
        if all_cores:
            print("RuntimeError: cannot bind the cores", flush=True)
            raise SystemExit(4)
        """) + textwrap.dedent(FAKE_SERVER))
    peer, runs = vllm_peer.run_vllm(peer_args(tmp_path, python), [SMALL], Progress(1, quiet=True))
    assert set(runs) == {"default"} and peer["faster"] == "default" and "skipped" not in peer
    default, every = peer["threads"]
    assert default["throughput_tok_s"] > 0 and "skipped" not in default
    assert "vLLM's server exited (4) before it was ready" in every["skipped"]
    assert "cannot bind the cores" in every["skipped"]
    (traces,) = runs["default"]
    versus = vllm_peer.compare(kv_rows(traces), traces, traces)
    peer.update(comparison=versus["rounds"], summary=versus["summary"])
    text = vllm_peer.comparison_text(peer, versus["goals"])
    assert "  default, vLLM's default threads (a core kept for its API server): ready in " in text
    assert "  all-cores, every core bound (VLLM_CPU_OMP_THREADS_BIND=" in text and \
        "VLLM_CPU_NUM_OF_RESERVED_CPU=0): skipped: vLLM's server exited (4)" in text
    assert "kvserve is compared with the faster (the higher output tok/s): default" in text


def test_run_session_keeps_its_signature_over_kvserves_client() -> None:
    class FakeClient:
        def __init__(self) -> None:
            self.requests: list[dict[str, Any]] = []

        def stream(self, **request: Any) -> Any:
            self.requests.append(request)
            n = request["max_tokens"]
            yield from (type("Chunk", (), {"token_id": 7})() for _ in range(n))
            yield Result("", (7,) * n, tuple(request["token_ids"]), "length", Usage(len(request["token_ids"]), 0, n),
                         Timings(0, 0, 0, 0))

    client = FakeClient()
    traces = run_session(client, SMALL, Progress(1, quiet=True), cache_salt="s")  # type: ignore[arg-type]
    assert [len(u) for u in traces] == [SMALL.rounds] * SMALL.users
    assert all(r["cache_salt"] == "s" and r["ignore_eos"] and r["max_tokens"] == SMALL.answer_tokens
               for r in client.requests)


# ---- figures and goals on synthetic traces ----------------------------------------------------


def trace(sent: float, arrivals: list[float], *, prompt_tokens: int = 100, cached: int = 0,
          token_ids: list[int] | None = None) -> StreamTrace:
    ids = token_ids if token_ids is not None else list(range(len(arrivals)))
    t = StreamTrace(token_ids=ids, arrivals=arrivals, sent=sent, end=arrivals[-1] + 0.01)
    t.result = Result("", tuple(ids), (), "length", Usage(prompt_tokens, cached, len(ids)), Timings(0, 0, 0, 0))
    return t


def session(ttfts: list[list[float]], gap: float, start: float = 0.0, answer: int = 4) -> list[list[StreamTrace]]:
    """traces[user][round]: each round sent when the last ended, its first token after ttft, then `gap`s."""
    out = []
    for user in ttfts:
        now = start
        rounds: list[StreamTrace] = []
        for ttft in user:
            t = trace(now, [now + ttft + gap * i for i in range(answer)], prompt_tokens=100 * (len(rounds) + 1),
                      cached=50 * len(rounds))
            rounds.append(t)
            now = t.end
        out.append(rounds)
    return out


def kv_rows(traces: list[list[StreamTrace]]) -> list[dict[str, Any]]:
    base = {"full_median_s": 1.0, "reuse_median_s": 0.1}
    return [multi_turn.round_row(r + 1, [u[r] for u in traces], [u[r] for u in traces], base)
            for r in range(len(traces[0]))]


def test_side_by_side_rounds_ratios_and_goals_with_several_users() -> None:
    kv = session([[1.0, 0.1, 0.2], [1.2, 0.3, 0.4]], gap=0.05)
    vllm = session([[0.8, 0.2, 0.4], [0.9, 0.4, 0.6]], gap=0.1)
    versus = vllm_peer.compare(kv_rows(kv), kv, vllm)
    first = versus["rounds"][0]
    assert first["kvserve_ttft_p50_s"] == pytest.approx(1.1) and first["vllm_ttft_p50_s"] == pytest.approx(0.85)
    assert first["ttft_ratio"] == pytest.approx(1.1 / 0.85)
    assert first["kvserve_itl_p50_s"] == pytest.approx(0.05) and first["vllm_itl_p50_s"] == pytest.approx(0.1)
    assert first["tok_s_ratio"] == pytest.approx(first["kvserve_tok_s"] / first["vllm_tok_s"])
    assert versus["rounds"][1]["vllm_hit_rate"] == pytest.approx(0.25)
    assert [row["round"] for row in versus["vllm_rounds"]] == [1, 2, 3]
    sm = versus["summary"]
    # Rounds 2 and 3 of both users, pooled: kvserve 0.1 0.2 0.3 0.4, vLLM 0.2 0.4 0.4 0.6.
    assert sm["kvserve_ttft_p50_rounds_2_plus_s"] == pytest.approx(0.25)
    assert sm["vllm_ttft_p50_rounds_2_plus_s"] == pytest.approx(0.4)
    assert sm["ttft_rounds_2_plus_ratio"] == pytest.approx(0.625)
    kv_span, vllm_span = max(t.end for u in kv for t in u), max(t.end for u in vllm for t in u)
    assert sm["kvserve_throughput_tok_s"] == pytest.approx(24 / kv_span)
    assert sm["throughput_ratio"] == pytest.approx(vllm_span / kv_span)
    assert (sm["same_answers"], sm["requests"]) == (6, 6)
    goals = versus["goals"]
    assert goals == {"ttft_rounds_2_plus_vs_vllm": {"value": pytest.approx(0.625), "goal": 1.0, "met": True},
                     "throughput_vs_vllm": {"value": pytest.approx(vllm_span / kv_span), "goal": 1.0, "met": True}}

    # The report: multi-turn's, then the peer's part, with its goals; its JSON carries vLLM's rows.
    report = {"settings": {"users": 2, "rate": 0, "rounds": 3, "system_tokens": 40, "user_tokens": 0,
                           "question_tokens": 8, "answer_tokens": 4, "model": "m"},
              "rounds": kv_rows(kv), "throughput_tok_s": 1.0, **multi_turn.summarize(kv_rows(kv))}
    peer = {"name": "vllm", "version": "0.32.0", "dtype": "float32", "kv_space_gib": 4,
            "threads": [{"name": "default", "env": {}, "startup_s": 95.0, "ttft_p50_rounds_2_plus_s": 0.6,
                         "throughput_tok_s": 9.5},
                        {"name": "all-cores", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                         "startup_s": 90.0, "ttft_p50_rounds_2_plus_s": 0.4, "throughput_tok_s": 12.25}],
            "faster": "all-cores", "comparison": versus["rounds"], "rounds": versus["vllm_rounds"], "summary": sm}
    report["goals"].update(goals)
    report["peer"] = peer
    text = multi_turn.report_text(report)
    assert "vs vLLM 0.32.0 (CPU build" in text and "kvserve TTFT p50" in text and "vLLM tok/s" in text
    # Both settings and their figures, and the faster, the one compared.
    assert "  default, vLLM's default threads (a core kept for its API server): ready in 95 s; TTFT p50 over " \
           "rounds 2-3 600.0 ms, output tok/s 9.5" in text
    assert "  all-cores, every core bound (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0): ready " \
           "in 90 s; TTFT p50 over rounds 2-3 400.0 ms, output tok/s 12.2" in text
    assert "kvserve is compared with the faster (the higher output tok/s): all-cores" in text
    assert "x = kvserve / vLLM all-cores" in text
    assert "over rounds 2-3: TTFT p50 kvserve 250.0 ms, vLLM 400.0 ms (x0.62)" in text
    assert "goal: kvserve TTFT p50 over rounds 2+ <= 1.0x vLLM's: met (x0.62)" in text
    assert "goal: kvserve output tok/s over the session >= 1.0x vLLM's: met" in text
    assert "answers identical to kvserve's: 6 of 6" in text
    json.dumps(report)  # every figure is JSON
    assert len(multi_turn.panels(report)) == 3  # multi-turn's, and TTFT and tok/s of both sides


def test_one_user_has_the_ttft_goal_only_and_it_can_fail() -> None:
    kv = session([[1.0, 0.5, 0.5]], gap=0.05)
    vllm = session([[1.0, 0.6, 0.6]], gap=0.05)
    versus = vllm_peer.compare(kv_rows(kv), kv, vllm)
    assert set(versus["goals"]) == {"ttft_rounds_2_plus_vs_vllm"}
    g = versus["goals"]["ttft_rounds_2_plus_vs_vllm"]
    assert g["goal"] == 0.7 and g["value"] == pytest.approx(0.5 / 0.6) and not g["met"]
    peer = {"version": "0.32.0", "dtype": "float32", "kv_space_gib": 4, "faster": "default",
            "threads": [{"name": "default", "env": {}, "startup_s": 1.0, "ttft_p50_rounds_2_plus_s": 0.6,
                         "throughput_tok_s": 10.0}],
            "comparison": versus["rounds"], "summary": versus["summary"]}
    assert "goal: kvserve TTFT p50 over rounds 2+ <= 0.7x vLLM's: NOT met (x0.83)" in \
        vllm_peer.comparison_text(peer, versus["goals"])


def test_different_answers_and_a_single_round_are_reported_as_they_are() -> None:
    kv = session([[0.3], [0.5]], gap=0.05)
    vllm = session([[0.6], [1.0]], gap=0.05)
    vllm[1][0].token_ids = [9, 9, 9, 9]
    versus = vllm_peer.compare(kv_rows(kv), kv, vllm)
    sm = versus["summary"]
    assert sm["ttft_rounds_2_plus_ratio"] == pytest.approx(0.4 / 0.8)  # one round: that round
    assert (sm["same_answers"], sm["requests"]) == (1, 2)
    assert vllm_peer.peer_goals(2, None, None) == {}
    assert vllm_peer.peer_goals(1, 0.5, 3.0) == {"ttft_rounds_2_plus_vs_vllm": {"value": 0.5, "goal": 0.7,
                                                                                "met": True}}
