"""`kvserve bench e2e` and the demo run end to end on a tiny model and report what they promise."""

from __future__ import annotations

import json

import pytest

from client import bench, demo
from tests.stack_fixtures import model_dir


@pytest.mark.slow
def test_bench_e2e_reports_cached_turns(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(model_dir("llama")), "--turns", "3", "--repeats", "1", "--system-chars", "200",
            "--max-tokens", "4", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["cached_tokens"] == 0
    # Each later turn reuses at least the whole previous prompt's full blocks.
    for prev, cur in zip(turns, turns[1:], strict=False):
        assert cur["cached_tokens"] >= prev["prompt_tokens"] // 16 * 16
    for t in turns:
        assert t["computed_tokens_uncached"] == t["prompt_tokens"]  # the baseline really recomputed all
        assert t["computed_tokens_cached"] == t["prompt_tokens"] - t["cached_tokens"]
        assert t["same_tokens"], f"turn {t['turn']}: the answer with the cache differs from the one without"
    assert all(t["computed_tokens_cached"] < t["computed_tokens_uncached"] for t in turns[1:])
    # The summary is read off the rows: growth from turn 2 (the first with a cached history) to the last.
    second, last = turns[1], turns[-1]
    assert report["last_turn_speedup"] == pytest.approx(last["ttft_uncached_s"] / last["ttft_cached_s"])
    assert report["uncached_growth"] == pytest.approx(last["ttft_uncached_s"] / second["ttft_uncached_s"])
    assert report["cached_growth"] == pytest.approx(last["ttft_cached_s"] / second["ttft_cached_s"])


@pytest.mark.slow
def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--model", str(model_dir("llama")), "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "ttft cached" in out and "ttft uncached" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert int(rows[0][3]) == 0 and all(int(r[3]) > 0 for r in rows[1:])
    assert "the answers were the same in all 6 turns" in out and "!" not in out


def test_demo_reports_where_the_cached_answer_differs(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.divergence((5, 6, 7), (5, 6, 7)) is None
    assert demo.divergence((5, 9, 7), (5, 6, 7)) == (
        "! the answers with and without the cache differ from token 1 on: 9 with, 6 without")
    assert demo.divergence((5, 6), (5, 6, 7)) == (
        "! the answers with and without the cache differ from token 2 on: none (ended) with, 7 without")
    demo.report_divergences([], 6)
    assert "the same in all 6 turns" in capsys.readouterr().out
    demo.report_divergences([2, 5], 6)
    assert "differed in 2 of 6 turns (2, 5)" in capsys.readouterr().out
