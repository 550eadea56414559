"""The demo runs end to end on a tiny model and reports what it promises (`kvserve bench e2e`, now
`multi-turn`, is tested in test_bench_suite.py)."""

from __future__ import annotations

import pytest

from kvserve.cli import demo
from tests.stack_fixtures import model_dir


@pytest.mark.slow
def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--model", str(model_dir("llama")), "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "ttft cached" in out and "ttft uncached" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert int(rows[0][3]) == 0 and all(int(r[3]) > 0 for r in rows[1:])
    assert "the answers were the same in all 6 turns" in out and "! the answers" not in out
    assert "\nalice: What is the capital of France?\nassistant: " in out
    # what it is doing, all along: how long it takes, each service, each request of each turn, the stop
    lines = out.splitlines()
    assert lines[0].startswith("Two users chat on model-llama ") and "then 6 turns" in lines[0]
    for name in ("kvstore", "prefill", "decode"):
        assert f"starting {name} ..." in lines and f"stopping {name} ..." in lines
        assert any(line.startswith(f"{name} ready on 127.0.0.1:") for line in lines), name
    steps = [line for line in lines if line.startswith("turn ") and line.endswith(" ...")]
    assert steps == [f"turn {t}/6, {user}: {how} the cache ..." for t, user in enumerate(["alice", "bob"] * 3, 1)
                     for how in ("without", "with")]
    assert lines[-1].startswith("stopped in ")


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
