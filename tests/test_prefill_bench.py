import json

import pytest

from engine import prefill_bench
from tests.engine_fixtures import tiny_model_path


def test_demo_reuses_the_cached_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert prefill_bench.main(["--model", str(tiny_model_path("llama")), "--prompt-tokens", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    prompt_tokens = report["prompt_tokens"]
    assert report["cold"] == {**report["cold"], "cached_tokens": 0, "computed_tokens": prompt_tokens}
    assert report["warm"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert report["same_next_token"] and report["max_logit_diff"] < 1e-4
    assert report["cold_vs_matmul"] > 0
