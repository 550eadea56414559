import json

import pytest

from kvserve.bench import step as step_bench
from kvserve.engine.engine import StepStats
from tests.engine_fixtures import make_engine, tiny_model, tiny_model_path


def test_reports_each_step_against_its_bound_and_the_fan_out(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(tiny_model_path("llama")), "--rows", "1,2", "--contexts", "16,40", "--steps", "2",
            "--bandwidth-mib", "8", "--fan-out", "3", "--fan-out-prefix", "20", "--fan-out-own", "5",
            "--fan-out-answer", "4", "--json", "-"]
    assert step_bench.main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert [(p["rows"], p["context"]) for p in report["points"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for p in report["points"]:
        assert p["step_over_bound"] == pytest.approx(p["step_ms"] / p["bound_ms"])
    fan = report["fan_out"]
    assert len(fan["runs_s"]) == step_bench.FAN_OUT_REPEATS
    assert fan["tok_s"] == pytest.approx(3 * 4 / sorted(fan["runs_s"])[1])


def test_fan_out_computes_the_shared_prefix_once() -> None:
    steps: list[StepStats] = []
    engine = make_engine(tiny_model("llama"), 16, 64, on_step=steps.append)
    assert step_bench.fan_out(engine, requests=4, prefix=32, own=5, answer=3, seed=0) > 0
    assert sum(s.num_prompt_tokens for s in steps) == 32 + 4 * 5
    assert sum(s.num_tokens for s in steps) == 32 + 4 * 5 + 4 * 2  # then each row's 2 decode steps
