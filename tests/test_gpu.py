"""The engine on CUDA: the same oracle checks as on the CPU. Skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.kv_codec import decode_block, encode_block
from engine.model import load_model
from tests.engine_fixtures import ARCHS, assert_greedy_matches, random_tokens, tiny_model_path
from tests.test_engine_generate import MAX_NEW_TOKENS, _engine_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_on_cuda_equals_hf_generate(arch: str) -> None:
    model = load_model(tiny_model_path(arch), device="cuda")
    prompt = random_tokens(40, seed=7)
    with torch.inference_mode():
        out = model.hf_model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    oracle = out.sequences[0, len(prompt):].tolist()
    got = _engine_greedy(Engine(model, block_size=8), prompt, MAX_NEW_TOKENS)
    assert_greedy_matches(got, oracle, [step[0] for step in out.logits])


def test_cached_prefix_on_cuda_through_the_codec() -> None:
    model = load_model(tiny_model_path("llama"), device="cuda")
    engine = Engine(model, block_size=8)
    prompt = random_tokens(37, seed=3)
    full = engine.prefill(prompt)
    namespace = engine.namespace()
    shape = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    cached = [decode_block(encode_block(kv, namespace), namespace, **shape, dtype=model.dtype, num_tokens=8)
              for kv in full.new_blocks[:3]]
    warm = engine.prefill(prompt, cached)
    torch.testing.assert_close(warm.logits, full.logits, atol=1e-4, rtol=0)
