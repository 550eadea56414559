"""`kvserve bench decode` on a tiny model: the token counts are right and every ratio it reports is the
one of the figures it reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from client.client import Result, Timings, Usage
from kvserve.bench import decode as decode_bench
from kvserve.bench import hf_batch as hf_batch_bench
from kvserve.bench.decode import gaps_overlapping, gaps_within, throughput_report
from kvserve.bench.report import percentile
from kvserve.bench.streams import StreamTrace
from tests.engine_fixtures import random_tokens, tiny_model_path
from tests.stack_fixtures import model_dir


def trace(arrivals: list[float]) -> StreamTrace:
    return StreamTrace(token_ids=list(range(len(arrivals))), arrivals=arrivals)


def test_itl_windows_take_the_gaps_they_say() -> None:
    traces = [trace([0.0, 1.0, 2.0, 3.0, 9.0, 10.0]), trace([0.5, 1.5, 2.5, 8.5])]
    # Before: gaps wholly between the steady start and the long request's arrival.
    assert sorted(gaps_within(traces, 1.0, 3.0)) == [1.0, 1.0, 1.0]
    # During: every gap that overlaps (arrival, second token), the stalled ones included.
    assert sorted(gaps_overlapping(traces, 3.5, 8.0)) == [6.0, 6.0]
    assert sorted(gaps_overlapping(traces, 2.0, 9.5)) == [1.0, 1.0, 1.0, 6.0, 6.0]
    values = [0.01 * i for i in range(1, 38)] + [2.0]
    assert percentile(values, 99) == pytest.approx(float(np.percentile(values, 99)))
    assert percentile([3.0], 99) == 3.0


def test_throughput_report_reads_ratios_off_the_runs() -> None:
    timeline = {"last_first_token_s": 0.1, "itl_median_s": 0.02}
    stack = [{"streams": 1, "generated_tokens": 8, "s": 0.5, "tok_s": 16.0, "token_ids": [[1, 2]], **timeline,
              "runs_s": [0.5, 0.4, 0.6]},
             {"streams": 16, "generated_tokens": 128, "s": 2.0, "tok_s": 64.0, "token_ids": [[1, 2]] * 15 + [[3, 4]],
              **timeline, "runs_s": [2.0, 2.0, 1.5]}]
    hf = {"torch_threads": 2, "runs": [
        {"streams": 1, "generated_tokens": 8, "s": 0.4, "tok_s": 20.0, "token_ids": [[1, 2]], "engine_tok_s": 18.0},
        {"streams": 16, "generated_tokens": 128, "s": 1.0, "tok_s": 128.0, "token_ids": [[1, 2]] * 16,
         "engine_tok_s": 96.0}]}
    report = throughput_report(stack, hf)
    row = report["rows"][1]
    assert row["stack_ratio"] == 4.0 and row["hf_ratio"] == 6.4 and row["stack_vs_hf"] == 0.5
    assert row["same_tokens_as_hf"] == 15 and row["engine_vs_hf"] == 0.75
    assert report["goals"]["scaling"]["each_repeat"] == pytest.approx([4.0, 3.2, 6.4])  # 16 s_one / s_top, paired
    assert report["goals"] == {"scaling": {"value": 4.0, "goal": 4.0, "met": True,
                                           "each_repeat": report["goals"]["scaling"]["each_repeat"]},
                               "vs_hf": {"value": 0.5, "goal": 0.7, "met": False}}


def test_check_tokens_refuses_a_short_stream() -> None:
    result = Result("", (1,), (), "length", Usage(4, 0, 1), Timings(0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="received 1 tokens"):
        decode_bench.check_tokens([StreamTrace([1], [0.0], result)], 2)


def test_hf_baseline_is_greedy_past_eos() -> None:
    """The baseline generates through the model's EOS (this prompt's greedy step 6 is EOS 260) and
    pads shorter prompts on the left without changing their tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), local_files_only=True).eval()
    prompt, short = random_tokens(16, seed=1), random_tokens(10, seed=2)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):  # greedy by hand: a full forward per token, no cache, no generate
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert 260 in ids[16:]
    tokens, _ = hf_batch_bench.generate(model, [prompt, short], 12)
    alone, _ = hf_batch_bench.generate(model, [short], 12)
    assert tokens == [ids[16:], alone[0]]


@pytest.mark.slow
def test_bench_decode_reports_measured_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new_tokens, long_tokens = 6, 300
    argv = ["--model", str(model_dir("llama")), "--streams", "1,2", "--prompt-tokens", "32", "--new-tokens",
            str(new_tokens), "--itl-streams", "2", "--itl-new-tokens", "240", "--baseline-tokens", "5",
            "--long-prompt-tokens", str(long_tokens), "--unchunked-budget", "512",
            "--json", str(tmp_path / "decode.json"), "--plot", str(tmp_path / "decode.png")]
    assert decode_bench.main(argv) == 0
    assert "stack tok/s" in capsys.readouterr().out  # the table
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((tmp_path / "decode.json").read_text())

    rows = report["throughput"]["rows"]
    assert [r["streams"] for r in rows] == [1, 2]
    base = rows[0]
    for r in rows:
        assert r["generated_tokens"] == r["hf_generated_tokens"] == r["streams"] * new_tokens
        assert r["stack_tok_s"] == pytest.approx(r["generated_tokens"] / r["stack_s"])
        assert len(r["stack_runs_s"]) == 3 and r["stack_s"] == sorted(r["stack_runs_s"])[1]  # the median of 3
        assert r["hf_tok_s"] == pytest.approx(r["hf_generated_tokens"] / r["hf_s"])
        assert r["stack_ratio"] == pytest.approx(r["stack_tok_s"] / base["stack_tok_s"])
        assert r["hf_ratio"] == pytest.approx(r["hf_tok_s"] / base["hf_tok_s"])
        assert r["stack_vs_hf"] == pytest.approx(r["stack_tok_s"] / r["hf_tok_s"])
        assert r["same_tokens_as_hf"] == r["streams"]  # greedy: the stack generates what HF generates
        assert r["engine_vs_hf"] == pytest.approx(r["engine_tok_s"] / r["hf_tok_s"])
    assert report["throughput"]["goals"] == {}  # no 16-stream level in this run

    itl = report["itl"]
    for name in ("chunked", "unchunked"):
        x = itl[name]
        # Decode computed the whole long prompt: prefill had it in its pool, the store had none of it.
        assert x["prefill_pool"] == {"cold_computed_tokens": long_tokens,
                                     "warm_cached_tokens": (long_tokens - 1) // 16 * 16, "store_hits": 0}
        assert x["long_prompt_tokens"] == long_tokens
        assert x["long_cached_tokens"] == (long_tokens - 1) // 16 * 16
        assert x["streams_decoding_throughout"]
        assert x["gaps_before_s"] and x["gaps_during_s"]
        assert x["itl_p99_before_s"] == pytest.approx(float(np.percentile(x["gaps_before_s"], 99)))
        assert x["itl_p99_during_s"] == pytest.approx(float(np.percentile(x["gaps_during_s"], 99)))
        assert x["ratio"] == pytest.approx(x["itl_p99_during_s"] / x["itl_p99_before_s"])
    goals = itl["goals"]
    assert goals["chunked"] == {"value": itl["chunked"]["ratio"], "goal": 3.0,
                                "met": itl["chunked"]["ratio"] <= 3.0}
    assert goals["unchunked_contrast"] == {"value": itl["unchunked"]["ratio"], "goal": 20.0,
                                           "met": itl["unchunked"]["ratio"] >= 20.0}
