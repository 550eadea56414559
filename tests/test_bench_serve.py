"""`kvserve bench serve` (kvserve/bench/serve.py) without a server: its flags, the workload it sends (its system prompt
sized in a model folder's tokenizer), the servers it starts (vLLM under both thread settings), the figures of
synthetic traces and the side-by-side report. No test starts a server or opens a connection."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench import serve
from kvserve.bench.serve import Load, ServerRun, Trace, Workload
from kvserve.cli.commands import forwarded
from tests.stack_fixtures import model_dir

W = Workload("chat", sessions=3, turns=2, system_words=50, question_words=6, answer_tokens=4, seed=7)


# ---- flags ------------------------------------------------------------------------------------


def test_the_defaults_start_every_server_with_a_system_prompt_of_2300_tokens_in_its_tokenizer() -> None:
    args = serve.parse_args([])
    assert args.servers == ["kvserve", "transformers", "vllm"]
    assert args.model_dir is None and args.target is None  # main resolves it (bench.target.ensure_model)
    assert (args.system_tokens, args.system_words) == (2300, None)
    args.model_dir = model_dir("llama")
    w, load = serve.workload(args)
    assert (w.scenario, w.sessions, w.turns, w.question_words, w.answer_tokens) == ("chat", 4, 4, 30, 32)
    assert w.system_tokens is not None and w.system_tokens >= 2300
    assert (w.system_words, w.system_tokens) == serve.system_words_for(model_dir("llama"), 2300, 0)
    assert load == Load(concurrency=4)
    w, _ = serve.workload(serve.parse_args(["--system-words", "12"]))  # words: no tokenizer needed
    assert (w.system_words, w.system_tokens) == (12, None)


def test_the_system_prompt_gets_the_fewest_words_that_reach_the_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))  # byte-level: a token per character

    def count(n: int) -> int:
        prompt = serve.system_prompt(Workload("chat", 1, 1, n, 1, 1, seed=3), "0" * 8)
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    words, tokens = serve.system_words_for(model_dir("llama"), 300, 3)
    assert tokens == count(words) >= 300 > count(words - 1)
    assert serve.system_words_for(model_dir("llama"), 0, 3) == (0, count(0))


def test_a_target_gets_ignore_eos_words_and_fan_out_its_own_sizes() -> None:
    args = serve.parse_args(["--target", "http://h:8000", "--scenario", "fan-out", "--requests", "9", "--rate", "2"])
    assert args.servers is None and args.extra_body == {"ignore_eos": True} and args.model_dir is None
    w, load = serve.workload(args)
    assert (w.sessions, w.turns, w.system_words, w.system_tokens) == (9, 1, 400, None)
    assert load == Load(rate=2.0)
    w, load = serve.workload(serve.parse_args(["--scenario", "fan-out", "--system-words", "5"]))
    assert (w.sessions, load) == (16, Load(concurrency=4))
    _, load = serve.workload(serve.parse_args(["--users", "2", "--concurrency", "8", "--system-words", "5"]))
    assert load == Load(concurrency=2)  # never more than there are sessions
    args = serve.parse_args(["--servers", "vllm,kvserve"])
    assert args.servers == ["vllm", "kvserve"]


@pytest.mark.parametrize("argv", [
    ["--concurrency", "2", "--rate", "1"],
    ["--target", "http://h", "--servers", "kvserve"],
    ["--servers", "kvserve,sglang"],
    ["--servers", "kvserve,kvserve"],
    ["--model", "m"],  # without --target
    ["--extra-body", "{}"],
    ["--target", "http://h", "--model-dir", "x"],
    ["--target", "http://h", "--system-tokens", "100"],  # no tokenizer at hand
    ["--system-tokens", "100", "--system-words", "10"],
    ["--system-tokens", "-1"],
    ["--target", "http://h", "--extra-body", "[1]"],
    ["--target", "http://h", "--extra-body", "{nope"],
    ["--scenario", "fan-out", "--rounds", "2"],
    ["--requests", "3"],  # chat
    ["--users", "0"],
    ["--answer-tokens", "0"],
    ["--rate", "0"],
    ["--request-timeout", "0"],
])
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_cli_forwards_bench_serve() -> None:
    found = forwarded(["bench", "serve", "--users", "2"])
    assert found is not None
    assert found[0] is serve.main and found[1] == ["--users", "2"]


def test_vllm_starts_once_for_each_thread_setting() -> None:
    runs = serve.server_runs(["kvserve", "vllm", "transformers"])
    default, every = serve.vllm_peer.thread_settings()
    assert runs == [ServerRun("kvserve"), ServerRun("vllm", default), ServerRun("vllm", every),
                    ServerRun("transformers")]
    assert [r.name for r in runs] == ["kvserve", "vllm-default", "vllm-all-cores", "transformers"]


def test_base_urls_end_in_v1() -> None:
    assert serve.base_url("http://h:8000") == "http://h:8000/v1"
    assert serve.base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert serve.base_url("https://h/api/v1") == "https://h/api/v1"


def test_what_each_server_is_sent_to_generate_past_eos() -> None:
    assert serve.EXTRA_BODIES["kvserve"] == serve.EXTRA_BODIES["vllm"] == {"ignore_eos": True}
    config = json.loads(serve.EXTRA_BODIES["transformers"]["generation_config"])
    assert config == {"eos_token_id": -1, "do_sample": False}
    command = serve.transformers_command(Path("m"), 1234)
    assert command[-1] == str(Path("m").resolve())  # the model name it answers to
    assert command[command.index("--port") + 1] == "1234" and "--continuous-batching" in command


# ---- the workload -----------------------------------------------------------------------------


def test_the_system_prompt_depends_on_the_seed_and_its_tag_only() -> None:
    a, b = serve.system_prompt(W, "aaaa"), serve.system_prompt(W, "bbbb")
    assert a.startswith("Session aaaa. ") and a.removeprefix("Session aaaa. ") == b.removeprefix("Session bbbb. ")
    assert len(a.split()) == 2 + W.system_words
    assert serve.system_prompt(W, "aaaa") == a
    assert serve.system_prompt(Workload("chat", 3, 2, 50, 6, 4, seed=8), "aaaa") != a


def test_every_question_is_its_own() -> None:
    asked = serve.questions(W)
    assert [len(s) for s in asked] == [2, 2, 2]
    flat = [q for s in asked for q in s]
    assert len(set(flat)) == len(flat)
    assert asked[1][0].startswith("Question 2.1: ") and asked[1][0].endswith("?")
    assert all(len(q.split()) == 2 + W.question_words for q in flat)
    assert serve.questions(W) == asked


def test_a_turn_carries_the_conversation_before_it() -> None:
    messages = serve.turn_messages("sys", ["q1", "q2", "q3"], ["a1", "a2"])
    assert messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    assert serve.turn_messages("sys", ["q1"], []) == messages[:2]
    with pytest.raises(ValueError):
        serve.turn_messages("sys", ["q1", "q2"], [])


def test_poisson_arrivals_start_at_once_and_keep_their_rate() -> None:
    due = serve.poisson_due(4.0, 2000, random.Random(1))
    assert due[0] == 0.0 and len(due) == 2000
    assert all(b > a for a, b in zip(due, due[1:], strict=False))
    assert 1900 / 4.0 * 0.9 < due[-1] < 2000 / 4.0 * 1.1
    assert serve.poisson_due(4.0, 5, random.Random(1)) == due[:5]


# ---- figures ----------------------------------------------------------------------------------


def trace(session: int, turn: int, sent: float, arrivals: list[float], end: float, *, prompt: int | None = 100,
          cached: int | None = 0, completion: int | None = 3, due: float | None = None) -> Trace:
    return Trace(session, turn, due, sent, arrivals, end, "x", prompt, cached, completion)


def test_figures_of_two_users_over_two_rounds() -> None:
    traces = [[trace(0, 0, 0.0, [1.0, 1.5, 2.5], 3.0, cached=0),
               trace(0, 1, 3.0, [3.2, 3.3], 4.0, cached=80)],
              [trace(1, 0, 0.0, [2.0, 2.25], 5.0, cached=0, due=0.0),
               trace(1, 1, 5.0, [5.4], 6.0, cached=60, completion=None, due=4.0)]]
    fig = serve.figures(traces)
    assert fig["requests"] == 4 and fig["prompt_tokens_mean"] == 100
    assert fig["cached_tokens"] == 140 and fig["hit_rate"] == pytest.approx(0.35)
    # TTFTs 1.0, 0.2, 2.0, 0.4: linear between ranks
    assert fig["ttft_p50_s"] == pytest.approx(0.7)
    assert fig["ttft_p90_s"] == pytest.approx(1.7)
    assert fig["ttft_p50_rounds_2_plus_s"] == pytest.approx(0.3)
    # gaps 0.5, 1.0, 0.1, 0.25
    assert fig["itl_p50_s"] == pytest.approx(0.375)
    assert fig["e2e_p50_s"] == pytest.approx(2.0)  # e2e 3, 1, 5, 1
    assert fig["output_tokens"] == 3 + 3 + 3 + 1  # the last reported no usage: its one content chunk
    assert fig["output_tok_s"] == pytest.approx(10 / 6)
    assert fig["tokens_from"] == "chunks" and fig["no_content"] == 0 and fig["held_back"] == 1
    rows = serve.round_rows(traces)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["ttft_p50_s"] == pytest.approx(1.5) and rows[1]["hit_rate"] == pytest.approx(0.7)


def test_no_cached_tokens_when_a_server_reports_none_and_no_ttft_without_content() -> None:
    traces = [[trace(0, 0, 0.0, [], 1.0, cached=None, completion=0)],
              [trace(1, 0, 0.0, [0.5], 1.0, cached=None)]]
    fig = serve.figures(traces)
    assert fig["cached_tokens"] is None and fig["hit_rate"] is None
    assert fig["ttft_p50_s"] == pytest.approx(0.5) and fig["no_content"] == 1
    assert fig["ttft_p50_rounds_2_plus_s"] is None and fig["itl_p50_s"] is None
    assert serve.compared_ttft(fig) == pytest.approx(0.5)
    assert math.isclose(fig["output_tok_s"], 3.0)


# ---- the report -------------------------------------------------------------------------------


def section(name: str, ttft: float, tok_s: float, cached: int | None) -> dict[str, Any]:
    fig: dict[str, Any] = {c.key: None for c in serve.METRICS}
    fig.update(requests=4, prompt_tokens_mean=2500.0, cached_tokens=cached, ttft_p50_s=ttft * 2,
               ttft_p50_rounds_2_plus_s=ttft, output_tokens=64, output_tok_s=tok_s, tokens_from="usage",
               held_back=0)
    return {"name": name, "url": f"http://{name}/v1", "model": "m", "version": "1.0", "startup_s": 5.0,
            "extra_body": {"ignore_eos": True} if name != "transformers" else {}, "notes": [], "figures": fig,
            "rounds": [{"round": 1, "ttft_p50_s": ttft * 2}, {"round": 2, "ttft_p50_s": ttft}]}


def report(*sections: dict[str, Any]) -> dict[str, Any]:
    ratios, goals = serve.comparison(sections)
    settings = {**serve.dataclasses.asdict(W), "load": Load(concurrency=3).describe(), "model": "m"}
    return {"settings": settings, "servers": list(sections), "ratios": ratios, "goals": goals}


def test_the_report_puts_the_servers_side_by_side_with_the_goals() -> None:
    r = report(section("kvserve", 0.1, 30.0, 900), section("transformers", 0.5, 8.0, None),
               {"name": "vllm", "skipped": "no vLLM: .venv-vllm/bin/python is missing"})
    assert r["ratios"]["transformers"] == {"ttft_ratio": pytest.approx(0.2), "tok_s_ratio": pytest.approx(3.75)}
    assert r["goals"]["ttft_vs_transformers"]["met"] and r["goals"]["throughput_vs_transformers"]["met"]
    text = serve.report_text(r)
    header = next(line for line in text.splitlines() if "kvserve" in line and "transformers" in line
                  and "vllm" in line)
    assert header.split() == ["kvserve", "transformers", "vllm"]
    row = next(line for line in text.splitlines() if line.startswith("TTFT p50 rounds 2+ ms"))
    assert row.split()[-3:] == ["100.0", "500.0", "-"]
    assert next(line for line in text.splitlines() if line.startswith("cached prompt tokens")).split()[-3:] == \
        ["900", "-", "-"]
    assert "vllm: skipped: no vLLM" in text
    assert "kvserve / transformers: TTFT p50 over rounds 2+ x0.20, output tok/s x3.75" in text
    assert "goal: kvserve TTFT p50 over rounds 2+ <= 0.3x transformers serve's: met (x0.20)" in text
    assert "goal: kvserve output tok/s >= 3x transformers serve's: met (x3.75)" in text
    assert "transformers 1.0 at http://transformers/v1, model 'm': extra body nothing; reports no cached" in text
    assert len(serve.panels(r)) == 3


def test_no_ratio_without_kvserve_and_no_goal_it_cannot_measure() -> None:
    assert serve.comparison([section("transformers", 0.5, 8.0, None)]) == ({}, {})
    slow = section("transformers", 0.5, 8.0, None)
    slow["figures"]["output_tok_s"] = None
    ratios, goals = serve.comparison([section("kvserve", 0.2, 10.0, 0), slow])
    assert ratios["transformers"]["tok_s_ratio"] is None and set(goals) == {"ttft_vs_transformers"}
    assert not goals["ttft_vs_transformers"]["met"]  # 0.4x
    text = serve.report_text(report(section("kvserve", 0.2, 10.0, 0),
                                    {"name": "transformers", "failed": "APIConnectionError: refused"}))
    assert "transformers: failed: APIConnectionError: refused" in text and "goal:" not in text


def test_kvserve_is_compared_with_vllm_at_its_faster_setting_and_both_are_shown() -> None:
    default = {**section("vllm-default", 0.4, 9.0, 800), "server": "vllm", "threads": "default", "env": {}}
    every = {**section("vllm-all-cores", 0.25, 12.0, 800), "server": "vllm", "threads": "all-cores",
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
    r = report({**section("kvserve", 0.1, 30.0, 900), "server": "kvserve"}, default, every)
    assert r["ratios"] == {"vllm": {"ttft_ratio": pytest.approx(0.4), "tok_s_ratio": pytest.approx(2.5),
                                    "against": "vllm-all-cores"}}
    text = serve.report_text(r)
    header = next(line for line in text.splitlines() if "kvserve" in line and "vllm-default" in line
                  and "vllm-all-cores" in line and "x" not in line)
    assert header.split() == ["kvserve", "vllm-default", "vllm-all-cores"]
    assert next(line for line in text.splitlines() if line.startswith("output tok/s")).split()[-3:] == \
        ["30.0", "9.0", "12.0"]
    assert "vllm-default 1.0 at http://vllm-default/v1, model 'm', vLLM's default threads (a core kept for its " \
           "API server): extra body" in text
    assert "vllm-all-cores 1.0 at http://vllm-all-cores/v1, model 'm', every core bound " \
           "(VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0): extra body" in text
    assert "kvserve / vllm at vllm-all-cores, the faster of its settings that ran (the higher output tok/s): " \
           "TTFT p50 over rounds 2+ x0.40, output tok/s x2.50" in text
    # The faster is the higher output tok/s, whichever has the lower TTFT; a setting that failed is not one.
    default["figures"]["output_tok_s"] = 15.0
    assert serve.comparison([r["servers"][0], default, every])[0]["vllm"]["against"] == "vllm-default"
    failed = {"name": "vllm-default", "server": "vllm", "failed": "APIConnectionError: refused"}
    assert serve.comparison([r["servers"][0], failed, every])[0]["vllm"]["against"] == "vllm-all-cores"
