"""`kvserve bench multi-turn | shared-prefix | handoff | store` in short forms on a tiny model: each runs,
writes a valid PNG and a JSON holding every figure its table names, and its figures add up. The report
helpers they share, and the model they run by default, are tested without a stack. No wall-clock
thresholds: timings are only read."""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from matplotlib import image
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from kvserve.bench import handoff as bench_handoff
from kvserve.bench import http_overhead as bench_http
from kvserve.bench import multi_turn as bench_multi_turn
from kvserve.bench import routing as bench_routing
from kvserve.bench import scaling as bench_scaling
from kvserve.bench import shared_prefix as bench_shared_prefix
from kvserve.bench import store as bench_store
from kvserve.bench import vllm_peer
from kvserve.bench.report import (
    Column,
    Line,
    Progress,
    bar_panel,
    format_table,
    goal,
    line_panel,
    percentiles_s,
    save_plot,
)
from kvserve.bench.target import ensure_model, free_port, local_stack, tiny_model_dir
from kvserve.cli import commands as cli
from kvserve.engine.fetch import DATA_DIR_ENV, REAL_MODEL, real_model_dir
from tests.stack_fixtures import BLOCK_SIZE, model_dir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def assert_has_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> None:
    assert rows
    for row in rows:
        missing = [c.key for c in columns if c.key not in row]
        assert not missing, f"figures of the table missing from the JSON: {missing}"


# ---- the shared report helpers ----------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_steps_on_a_terminal_only() -> None:
    tty, pipe = Terminal(), io.StringIO()
    with Progress(4, "bench", stream=tty) as bar, Progress(4, "bench", stream=pipe) as silent:
        bar.step()
        bar.step(2, label="phase two")
        silent.step()
        assert bar.line().startswith("phase two [##################------] 3/4 ")
    assert "\rbench [######------------------] 1/4 " in tty.getvalue()
    assert tty.getvalue().endswith("\r\x1b[K")  # the line is cleared at the end
    assert pipe.getvalue() == ""
    with Progress(1, stream=Terminal(), quiet=True) as quiet:
        quiet.step()
        assert not quiet.enabled


def test_table_shows_each_column_of_each_row() -> None:
    columns = [Column("mode", "mode", "{}", left=True), Column("n", "users", "{:d}"),
               Column("ttft_s", "TTFT ms", "{:.1f}", 1000)]
    table = format_table(columns, [{"mode": "at once", "n": 16, "ttft_s": 0.0125}, {"mode": "x", "n": 1, "ttft_s": None}])
    assert table.splitlines() == ["mode     users  TTFT ms",
                                  "at once     16     12.5",
                                  "x            1        -"]


def test_percentiles_and_goals() -> None:
    assert percentiles_s("ttft", [0.1 * i for i in range(1, 11)]) == pytest.approx(
        {"ttft_p50_s": 0.55, "ttft_p90_s": 0.91, "ttft_p99_s": 0.991})
    assert percentiles_s("itl", []) == {"itl_p50_s": None, "itl_p90_s": None, "itl_p99_s": None}
    assert goal(1.5, 1.5, at_most=True)["met"] and not goal(1.6, 1.5, at_most=True)["met"]
    assert goal(5.0, 5.0, at_most=False) == {"value": 5.0, "goal": 5.0, "met": True}


def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "plots" / "two.png"
    save_plot(path, "two panels", [
        line_panel("lines", "users", "ms", [Line("a", [1, 4], [2.0, None]), Line("b", [1, 4], [1.0, 1.0], dashed=True)]),
        bar_panel("bars", "ms", {"stack": 3.0, "baseline": 2.0}, spread={"stack": (2.5, 4.0), "baseline": (2.0, 2.0)},
                  ref=("memcpy", 5.0)),
    ])
    assert_png(path)


@pytest.mark.parametrize(("name", "module"), [
    ("hash", "kvserve.bench.hashing"), ("prefill", "kvserve.bench.prefill"), ("multi-turn", "kvserve.bench.multi_turn"),
    ("e2e", "kvserve.bench.multi_turn"), ("shared-prefix", "kvserve.bench.shared_prefix"), ("decode", "kvserve.bench.decode"),
    ("handoff", "kvserve.bench.handoff"), ("store", "kvserve.bench.store"), ("serve", "kvserve.bench.serve"), ("http", "kvserve.bench.http_overhead"),
    ("scaling", "kvserve.bench.scaling"),
])
def test_bench_commands_are_dispatched(name: str, module: str) -> None:
    command = cli.forwarded(["bench", name, "--json", "out.json"])
    assert command is not None
    main, rest = command
    assert (main.__module__, main.__name__, rest) == (module, "main", ["--json", "out.json"])


def test_environ_sets_variables_and_restores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_PROBE_SET", "before")
    monkeypatch.delenv("KVSERVE_PROBE_UNSET", raising=False)
    with bench_routing.environ(KVSERVE_PROBE_SET="during", KVSERVE_PROBE_UNSET="during"):
        assert (os.environ["KVSERVE_PROBE_SET"], os.environ["KVSERVE_PROBE_UNSET"]) == ("during", "during")
    assert (os.environ["KVSERVE_PROBE_SET"], os.environ.get("KVSERVE_PROBE_UNSET")) == ("before", None)


def test_benchmarks_run_the_real_model_by_default_where_it_has_been_fetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data"))  # the model folders are under the data dir
    tiny, real = tiny_model_dir(), real_model_dir()
    assert (tiny, real) == (tmp_path / "data" / "models" / "tiny-llama", tmp_path / "data" / "models" / REAL_MODEL)
    tiny.mkdir(parents=True)
    (tiny / "config.json").write_text("{}")  # built already: nothing to build
    assert ensure_model(None) == tiny
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"no {REAL_MODEL} in {real}: benchmarking the tiny")
    assert f"`kvserve model fetch {REAL_MODEL}`" in said[0]
    real.mkdir(parents=True)
    assert ensure_model(None) == tiny  # a folder without its config is not fetched
    (real / "config.json").write_text("{}")
    capsys.readouterr()
    assert ensure_model(None) == real
    assert ensure_model(Path("elsewhere")) == Path("elsewhere")  # a folder given is taken as it is
    assert capsys.readouterr().err == ""
    for parse in (bench_multi_turn.parse_args, bench_scaling.parse_args, bench_http.parse_args):
        args = parse([])
        assert getattr(args, "model", getattr(args, "model_dir", "-")) is None  # main resolves it


def test_the_cli_keeps_its_own_commands() -> None:
    assert cli.forwarded(["bench", "nothing"]) is None
    assert cli.forwarded(["generate", "hi"]) is None


# ---- the scenarios, short forms -------------------------------------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator[list[str]]:
    """A stack with metrics pages, shared by the scenarios run with --addr: the flags that name it."""
    ports = {service: free_port() for service in ("kvstore", "prefill", "decode")}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-suite-") as tmp, \
            local_stack(model_dir("llama"), Path(tmp), "stack", None, metrics_ports=ports) as s:
        yield ["--model", str(model_dir("llama")), "--addr", s.addr, "--kvstore", s.service("kvstore").addr,
               *(f"--metrics=http://127.0.0.1:{p}/metrics" for p in ports.values())]


def run_bench(main: Any, argv: list[str], tmp_path: Path) -> dict[str, Any]:
    assert main([*argv, "--json", str(tmp_path / "figures.json"), "--plot", str(tmp_path / "plot.png")]) == 0
    assert_png(tmp_path / "plot.png")
    return dict(json.loads((tmp_path / "figures.json").read_text()))


@pytest.mark.slow
def test_multi_turn_starts_its_stack_and_reuses_each_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    system, question, answer = 64, 16, 4
    r = run_bench(bench_multi_turn.main, ["--model", str(model_dir("llama")), "--users", "2", "--rounds", "2",
                                          "--system-tokens", str(system), "--question-tokens", str(question),
                                          "--answer-tokens", str(answer), "--rate", "0"], tmp_path)
    assert "round" in capsys.readouterr().out
    rows = r["rounds"]
    assert_has_columns(rows, [*bench_multi_turn.TTFT_COLUMNS, *bench_multi_turn.STREAM_COLUMNS])
    assert [row["round"] for row in rows] == [1, 2]
    assert [row["prompt_tokens"] for row in rows] == [system + question, system + 2 * question + answer]
    # Round 2 reuses round 1's whole prompt and its answer up to the last full block; without the cache,
    # every prompt token of both users is computed.
    reused = (system + question + answer) // BLOCK_SIZE * BLOCK_SIZE
    assert rows[1]["computed_tokens"] == 2 * (rows[1]["prompt_tokens"] - reused)
    assert rows[1]["hit_rate"] == pytest.approx(reused / rows[1]["prompt_tokens"])
    assert all(row["computed_tokens_no_cache"] == 2 * row["prompt_tokens"] for row in rows)
    assert all(row["same_answers"] for row in rows)
    for row in rows:
        for key in ("ttft_cache", "ttft_no_cache", "itl", "e2e"):
            assert row[f"{key}_p50_s"] <= row[f"{key}_p90_s"] <= row[f"{key}_p99_s"]
        assert row["hf_full_ttft_s"] > 0 and row["reuse_ttft_s"] > 0
    first, last = rows[0], rows[-1]
    assert r["goals"]["ttft_growth"]["value"] == pytest.approx(last["ttft_cache_p50_s"] / first["ttft_cache_p50_s"])
    assert r["goals"]["last_round_speedup"]["value"] == pytest.approx(
        last["ttft_no_cache_p50_s"] / last["ttft_cache_p50_s"])


def test_scaling_runs_one_user_then_many_then_one_each_with_prompts_of_its_own() -> None:
    args = bench_scaling.parse_args(["--users", "8", "--rate", "2", "--repeats", "2", "--seed", "5"])
    plan = bench_scaling.sessions(args)
    assert [(s.users, s.rate) for s in plan] == [(1, 0.0), (8, 2.0), (1, 0.0)] * 2
    assert [s.seed for s in plan] == list(range(5, 11))
    rows = bench_scaling.repeats([10.0, 36.0, 8.0, 12.0, 30.0, 8.0])
    assert [r["ratio"] for r in rows] == [4.0, 3.0]  # over the mean of the one-user sessions around it
    assert rows[1] == {"one_user_before_tok_s": 12.0, "one_user_after_tok_s": 8.0, "users_tok_s": 30.0, "ratio": 3.0}


def test_scaling_reports_both_vllm_settings_and_plots_the_faster() -> None:
    rows = bench_scaling.repeats([10.0, 36.0, 8.0])
    default: dict[str, Any] = {
        "name": "default", "env": {}, "startup_s": 80.0, "ttft_p50_rounds_2_plus_s": 0.5, "throughput_tok_s": 20.0,
        "repeats": bench_scaling.repeats([5.0, 10.0, 5.0])}
    every: dict[str, Any] = {
        "name": "all-cores", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        "startup_s": 70.0, "ttft_p50_rounds_2_plus_s": 0.3, "throughput_tok_s": 30.0,
        "repeats": bench_scaling.repeats([8.0, 24.0, 8.0])}
    r: dict[str, Any] = {
        "settings": {"users": 4, "rate": 2.0, "rounds": 3, "system_tokens": 48, "question_tokens": 16,
                     "answer_tokens": 4, "repeats": 1, "seed": 0, "model": "m", "peer": "vllm"},
        "repeats": rows, "goals": {"ratio_every_repeat": goal(4.0, 3.0, at_most=False)},
        "peer": {"name": "vllm", "version": "0.32.0", "dtype": "float32", "kv_space_gib": 4,
                 "threads": [default, every], "faster": "all-cores"}}
    text = bench_scaling.report_text(r)
    assert "  default, vLLM's default threads (a core kept for its API server): ready in 80 s; TTFT p50 over " \
           "rounds 2-3 500.0 ms, output tok/s 20.0" in text
    assert "kvserve is compared with the faster (the higher output tok/s): all-cores" in text
    assert "vLLM, default:" in text and "vLLM, all-cores:" in text
    assert text.index("vLLM, all-cores:") < text.index("3.00") < text.index("goal:")  # its N / 1
    assert vllm_peer.faster(r["peer"]) is every
    ax = Figure().subplots()
    bench_scaling.panels(r)[1](ax)  # the ratios' bars: kvserve's and the faster setting's
    assert [p.get_height() for p in ax.patches if isinstance(p, Rectangle)] == [4.0, 3.0]


@pytest.mark.slow
def test_scaling_reports_each_repeat_and_the_worst_ratio_as_its_goal(stack: list[str], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench(bench_scaling.main, [*stack, "--users", "2", "--rate", "0", "--rounds", "2", "--system-tokens", "48",
                                       "--question-tokens", "16", "--answer-tokens", "4", "--repeats", "2"], tmp_path)
    assert "N / 1" in capsys.readouterr().out
    rows = r["repeats"]
    assert_has_columns([{"repeat": 1, **row} for row in rows], bench_scaling.COLUMNS)
    assert len(rows) == 2 and "peer" not in r
    for row in rows:
        one = (row["one_user_before_tok_s"] + row["one_user_after_tok_s"]) / 2
        assert row["ratio"] == pytest.approx(row["users_tok_s"] / one)
    assert r["goals"]["ratio_every_repeat"] == {"value": min(row["ratio"] for row in rows), "goal": 3.0,
                                                "met": min(row["ratio"] for row in rows) >= 3.0}


@pytest.mark.slow
def test_shared_prefix_counts_computed_tokens_against_the_ideal(stack: list[str], tmp_path: Path) -> None:
    prefix, question = 64, 16
    r = run_bench(bench_shared_prefix.main, [*stack, "--users", "1,2", "--prefix-tokens", str(prefix),
                                             "--question-tokens", str(question), "--answer-tokens", "2",
                                             "--stagger-ms", "20", "--cold-repeats", "1"], tmp_path)
    rows = r["runs"]
    assert_has_columns(rows, bench_shared_prefix.COLUMNS)
    assert [(row["mode"], row["users"]) for row in rows] == [("at once", 1), ("at once", 2), ("staggered", 1),
                                                             ("staggered", 2)]
    assert r["settings"]["metrics_read"]
    for row in rows:
        assert row["ideal_tokens"] == prefix + row["users"] * question
        assert row["computed_tokens_usage"] >= row["ideal_tokens"]
        assert row["computed_tokens_engine"] >= row["ideal_tokens"]  # prefill's engine computed at least that
        assert row["computed_vs_ideal"] == pytest.approx(row["computed_tokens_engine"] / row["ideal_tokens"])
        assert row["ttft_p50_vs_cold"] == pytest.approx(row["ttft_p50_s"] / r["cold_ttft_s"])
    # One user alone computes exactly its prompt.
    assert [row["computed_tokens_usage"] for row in rows if row["users"] == 1] == [prefix + question] * 2
    assert set(r["goals"]) == {"computed_at_once", "ttft_at_once", "computed_staggered", "ttft_staggered"}


@pytest.mark.slow
def test_handoff_takes_the_prefix_from_the_store(stack: list[str], tmp_path: Path) -> None:
    prefix, new = 64, 8
    r = run_bench(bench_handoff.main, [*stack, "--prefix-tokens", str(prefix), "--new-tokens", str(new),
                                       "--repeats", "2"], tmp_path)
    assert_has_columns(r["rows"], bench_handoff.COLUMNS)
    assert_has_columns(r["service_timings"], bench_handoff.TIMING_COLUMNS)
    assert [row["path"] for row in r["rows"]] == ["stack", "in-process reuse"]
    # Every block of the prefix came from the store, none from prefill's pool.
    assert r["cached_tokens_per_request"] == r["store_tokens_per_request"] == prefix
    assert r["pool_hit_tokens_per_request"] == 0
    assert all(run["stored_blocks"] == prefix // BLOCK_SIZE for run in r["runs"])
    stack_row, reuse = r["rows"]
    for row in r["rows"]:
        assert row["ttft_min_s"] <= row["ttft_p50_s"] <= row["ttft_max_s"]
    assert r["stack_vs_in_process"] == pytest.approx(stack_row["ttft_p50_s"] / reuse["ttft_p50_s"])
    # each request against the baseline's round just before it
    assert len(r["pair_ratios"]) == len(r["runs"]) == 2 and all(x > 0 for x in r["pair_ratios"])
    assert r["goals"]["stack_vs_in_process"]["value"] == r["stack_vs_in_process"]


@pytest.mark.slow
def test_store_reports_every_path_against_memcpy(tmp_path: Path) -> None:
    r = run_bench(bench_store.main, ["--total", "4MiB", "--repeat", "1", "--batch", "8"], tmp_path)
    assert_has_columns(r["rows"], bench_store.COLUMNS)
    assert r["rows"][0]["path"] == "memcpy" and r["rows"][0]["vs_memcpy"] == 1.0
    assert {row["path"] for row in r["rows"][1:]} == {"block_memcpy", *r["measured"]["gbps"]}
    for row in r["rows"]:
        assert row["vs_memcpy"] == pytest.approx(row["gbps"] / r["measured"]["memcpy_gbps"])
    assert r["goals"] and all(set(g) >= {"value", "goal", "met"} for g in r["goals"].values())


@pytest.mark.slow
def test_store_device_arena_reports_put_and_hand_off_against_a_device_copy(tmp_path: Path) -> None:
    """`--device cpu`: the CUDA bench's code on a CPU arena (its figures mean nothing for a GPU)."""
    r = run_bench(bench_store.main, ["--device", "cpu", "--total", "4MiB", "--repeat", "1", "--batch", "4"], tmp_path)
    assert_has_columns(r["rows"], bench_store.DEVICE_COLUMNS)
    assert [row["path"] for row in r["rows"]] == ["copy", "index_copy", "put", "get"]
    assert r["measured"]["blocks"] == 5 and r["measured"]["checksum_failures"] == 0
    for row in r["rows"]:
        assert row["vs_copy"] == pytest.approx(row["gbps"] / r["measured"]["gbps"]["copy"])
    assert set(r["goals"]["handoff"]) >= {"value", "goal", "met"}


@pytest.mark.slow
def test_http_compares_each_path_in_pairs_and_counts_the_fronts_cpu(tmp_path: Path) -> None:
    r = run_bench(bench_http.main, ["--model-dir", str(model_dir("llama")), "--pairs", "1", "--concurrency", "2",
                                    "--system-words", "20", "--question-words", "4", "--answer-tokens", "6",
                                    "--quiet"], tmp_path)
    assert [r["paths"][p]["requests"] for p in ("grpc", "http")] == [2, 2]
    assert all(r["paths"][p]["ttft_p50_s"] > 0 and r["paths"][p]["itl_p50_s"] > 0 for p in ("grpc", "http"))
    assert r["paired"]["ttft_ratio"] > 0 and r["http_cpu"]["seconds"] > 0
    assert set(r["goals"]) == {"ttft", "itl"}
