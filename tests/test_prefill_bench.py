import json

import pytest

from kvserve.bench import prefill as prefill_bench
from tests.engine_fixtures import tiny_model, tiny_model_path


def test_demo_reuses_the_cached_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert prefill_bench.main(["--model", str(tiny_model_path("llama")), "--prompt-tokens", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    prompt_tokens, cold, warm = report["prompt_tokens"], report["cold"], report["warm"]
    assert cold == {**cold, "cached_tokens": 0, "computed_tokens": prompt_tokens}
    assert warm["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert warm["computed_tokens"] == prompt_tokens - warm["cached_tokens"] < cold["computed_tokens"]
    assert report["same_next_token"] and report["max_logit_diff"] < 1e-4
    # The ratios are those of the times measured and of this prompt's arithmetic.
    assert report["speedup"] == pytest.approx(cold["s"] / warm["s"])
    flops = prefill_bench.prefill_flops(tiny_model("llama"), prompt_tokens)
    assert report["cold_gflops_per_s"] == pytest.approx(flops / cold["s"] / 1e9)
    assert report["cold_vs_matmul"] == pytest.approx(report["cold_gflops_per_s"] / report["matmul_gflops_per_s"])
