"""The engine in the dtype and on the device a service is told (--dtype, --device): the model, its KV pool and
greedy output against Hugging Face ``generate`` on the same model in the same dtype. The CUDA tests are marked
gpu and skipped where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.model import Model, load_model, model_dtype
from kvserve.engine.paged_attention import chunk_mask
from kvserve.engine.tiny import init_tiny_model
from prefill_service.__main__ import parser as prefill_parser
from tests.engine_fixtures import assert_matches_oracle, make_engine, make_seq, random_tokens, run

BLOCK = 16
NEW_TOKENS = 16
# Near-tie gaps as in test_gpu.py: bf16 logits of magnitude 2-4 are a few 1/64 apart at the closest.
NEAR_TIE = {torch.bfloat16: 0.1, torch.float32: 1e-3}
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def bf16_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, hidden-128 llama saved in bfloat16 (its config names bfloat16)."""
    return init_tiny_model(
        tmp_path_factory.mktemp("llama-bf16"), "llama", layers=2, hidden=128, dtype=torch.bfloat16
    )


def _prompts() -> list[list[int]]:
    return [random_tokens(n, seed=300 + n) for n in (5, 40, 77)]


def _run_against_oracle(model: Model, dtype: torch.dtype, in_place: bool | None = None,
                        caplog: pytest.LogCaptureFixture | None = None) -> None:
    """Three streams, prompts in chunks of 32 tokens (the 77-token one over three steps, its later chunks
    attending to earlier context), each equal to the oracle's greedy tokens. `in_place`: attention through the C
    kernels (True, where they are built) or SDPA over gathered blocks (False); None: as the engine chose."""
    engine = make_engine(model, BLOCK, 32, max_num_batched_tokens=32, max_num_seqs=4)
    assert (engine.kv_cache.kv.dtype, engine.kv_cache.kv.device.type) == (dtype, model.device.type)
    if in_place is not None:
        assert engine.runner.in_place_decode == engine.runner.in_place_chunks == (native.decode_kernel() is not None)
        if not in_place:
            engine.runner.in_place_decode = engine.runner.in_place_chunks = False
    seqs = [make_seq(model, p, NEW_TOKENS) for p in _prompts()]
    for seq, outcome in zip(seqs, run(engine, seqs), strict=True):
        assert_matches_oracle(model, seq, outcome, NEAR_TIE[dtype])
    if caplog is not None:  # every step ran as one batch: none failed and was retried sequence by sequence
        assert not [r for r in caplog.records if "retrying each alone" in r.getMessage()]


def test_auto_loads_the_dtype_the_config_names_and_a_name_overrides_it(bf16_path: Path) -> None:
    model = load_model(bf16_path)
    assert model.dtype == torch.bfloat16 and model.kv_dtype_name == "bfloat16"
    assert {p.dtype for p in model.hf_model.parameters()} == {torch.bfloat16}
    assert load_model(bf16_path, dtype="float32").dtype == torch.float32


def test_model_dtype_is_float32_when_the_config_names_none(bf16_path: Path) -> None:
    config = load_model(bf16_path).hf_model.config
    assert model_dtype(config) == torch.bfloat16
    assert model_dtype(config, "float16") == torch.float16
    config.dtype = None
    assert model_dtype(config) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        model_dtype(config, "int8")


def test_the_services_take_a_dtype() -> None:
    assert prefill_parser().parse_args(["--model", "m"]).dtype == "auto"
    assert prefill_parser().parse_args(["--model", "m", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        prefill_parser().parse_args(["--model", "m", "--dtype", "int8"])


@pytest.mark.parametrize("in_place", [True, False], ids=["C kernels", "SDPA"])
def test_bfloat16_on_cpu_equals_hf_generate_in_bfloat16(bf16_path: Path, in_place: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    if in_place and native.decode_kernel() is None:
        pytest.skip("no C kernels here")
    _run_against_oracle(load_model(bf16_path, dtype="bfloat16"), torch.bfloat16, in_place, caplog)


def test_a_chunk_over_earlier_context_gets_a_mask_only_on_cpu() -> None:
    mask = chunk_mask(3, 6, torch.device("cpu"))
    assert mask is not None and mask.tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 6]
    assert chunk_mask(0, 6, torch.device("cpu")) is None  # the whole context: plain causal
    assert chunk_mask(8192, 16384, torch.device("cuda")) is None  # the kernel aligns it; nothing built


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_on_cuda_equals_hf_generate(bf16_path: Path, dtype: torch.dtype) -> None:
    _run_against_oracle(load_model(bf16_path, device="cuda", dtype=dtype), dtype)


@pytest.mark.gpu
@cuda_only
def test_a_long_prompt_on_cuda_builds_no_score_matrix(bf16_path: Path) -> None:
    """A 4000-token prompt in chunks of 2048: the second chunk attends to 4000 keys. Math-kernel scores would
    be 2 heads x 1952 x 4000 x 4 B = 62 MB; the kernels that align the causal mask themselves need none."""
    model = load_model(bf16_path, device="cuda", dtype="bfloat16")
    engine = make_engine(model, BLOCK, 260, max_num_batched_tokens=2048, max_num_seqs=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (outcome,) = run(engine, [make_seq(model, random_tokens(4000, seed=310), 2)])
    assert len(outcome.tokens) == 2
    assert torch.cuda.max_memory_allocated() - before < 32 << 20
