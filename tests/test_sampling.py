import pytest
import torch

from engine.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def _draws(params: SamplingParams, n: int = 300) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(LOGITS) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    assert _draws(SamplingParams(), 5) == [5] * 5


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    assert _draws(params) == _draws(params)
    assert _draws(params) != _draws(SamplingParams(temperature=1.0, seed=8))
    assert len(set(_draws(params))) == 6


def test_top_k_restricts_support() -> None:
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=0))) == {0, 5}


def test_top_p_restricts_support() -> None:
    probs = torch.softmax(LOGITS, -1)  # sorted: 5 (0.60), 0 (0.22), 1 (0.08), ...
    top_p = float(probs[5] + probs[0]) - 1e-3
    assert set(_draws(SamplingParams(temperature=1.0, top_p=top_p, seed=0))) == {0, 5}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.01, seed=0))) == {5}


def test_low_temperature_concentrates() -> None:
    assert set(_draws(SamplingParams(temperature=0.01, seed=0))) == {5}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_invalid_params(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
