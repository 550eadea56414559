"""`kvserve bench e2e` and the demo run end to end on a tiny model and report what they promise."""

from __future__ import annotations

import json

import pytest

from client import bench, demo
from tests.stack_fixtures import model_dir

pytestmark = pytest.mark.slow


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
    assert report["last_turn_speedup"] > 0


def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--model", str(model_dir("llama")), "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "ttft cached" in out and "ttft uncached" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert int(rows[0][3]) == 0 and all(int(r[3]) > 0 for r in rows[1:])
