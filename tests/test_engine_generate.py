import pytest
import torch

from engine.engine import Engine
from engine.sampling import Sampler, SamplingParams
from tests.engine_fixtures import ARCHS, assert_greedy_matches, random_tokens, tiny_model

MAX_NEW_TOKENS = 24


def _engine_greedy(engine: Engine, prompt: list[int], max_new_tokens: int) -> list[int]:
    sampler = Sampler(SamplingParams())
    result = engine.prefill(prompt)
    out = [sampler.sample(result.logits)]
    while len(out) < max_new_tokens and out[-1] not in engine.model.eos_token_ids:
        out.append(sampler.sample(engine.decode_step([result.sequence], [out[-1]])[0]))
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_len", [5, 40])
def test_greedy_equals_hf_generate(arch: str, prompt_len: int) -> None:
    model = tiny_model(arch)
    prompt = random_tokens(prompt_len, seed=prompt_len)
    with torch.inference_mode():
        out = model.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    oracle = out.sequences[0, prompt_len:].tolist()
    got = _engine_greedy(Engine(model, block_size=8), prompt, MAX_NEW_TOKENS)
    assert_greedy_matches(got, oracle, [step[0] for step in out.logits])


def test_near_tie_helper() -> None:
    tie = torch.tensor([1.0, 1.0005, -3.0])
    clear = torch.tensor([1.0, 2.0, -3.0])
    assert_greedy_matches([0, 7], [1, 2], [tie, clear])  # diverged at a near-tie: allowed
    with pytest.raises(AssertionError):
        assert_greedy_matches([0], [1], [clear])
    with pytest.raises(AssertionError):
        assert_greedy_matches([1], [1, 2], [clear, clear])
