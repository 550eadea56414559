import pytest
import torch

from kvserve.engine.sampling import Sampler, SamplingParams, sample_batch

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


MIX = [
    SamplingParams(),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=4),
    SamplingParams(temperature=2.0, top_k=40, seed=5),
]


def _logits(steps: int, rows: int, vocab: int = 40) -> torch.Tensor:
    return 3 * torch.randn(steps, rows, vocab, generator=torch.Generator().manual_seed(11))  # [steps, rows, vocab]


def test_sample_batch_gives_each_row_what_its_sampler_gives_alone() -> None:
    logits = _logits(60, len(MIX))
    alone = [Sampler(p) for p in MIX]
    batched = [Sampler(p) for p in MIX]
    want = [[s.sample(step[i]) for step in logits] for i, s in enumerate(alone)]
    got = [sample_batch(step, batched) for step in logits]
    assert [[row[i] for row in got] for i in range(len(MIX))] == want
    assert all(len(set(tokens)) > 1 for tokens in want)  # every row saw many different tokens


def test_sample_batch_rows_do_not_depend_on_their_neighbours() -> None:
    logits = _logits(40, len(MIX))
    order = [5, 0, 3, 6, 1, 4, 2]
    together = [Sampler(p) for p in MIX]
    shuffled = [Sampler(MIX[i]) for i in order]
    pairs = [[Sampler(MIX[i]), Sampler(MIX[(i + 1) % len(MIX)])] for i in range(len(MIX))]
    for step in logits:
        a = sample_batch(step, together)
        b = sample_batch(step[order], shuffled)
        assert [b[order.index(i)] for i in range(len(MIX))] == a
        assert [sample_batch(step[[i, (i + 1) % len(MIX)]], pair)[0] for i, pair in enumerate(pairs)] == a


def test_greedy_rows_of_a_batch_are_argmax_and_draw_nothing() -> None:
    logits = _logits(20, len(MIX))
    samplers = [Sampler(p) for p in MIX]
    for step in logits:
        tokens = sample_batch(step, samplers)
        assert [tokens[0], tokens[4]] == step[[0, 4]].argmax(-1).tolist()
    assert sample_batch(logits[0].to(torch.bfloat16), [Sampler(SamplingParams())] * len(MIX)) == \
        logits[0].to(torch.bfloat16).float().argmax(-1).tolist()
    greedy = Sampler(SamplingParams(seed=9))
    state = greedy.generator.get_state()
    sample_batch(logits[0], [greedy] * len(MIX))
    assert torch.equal(greedy.generator.get_state(), state)


def test_a_sampler_started_at_step_k_draws_what_one_from_step_0_draws_from_k_on() -> None:
    logits = _logits(30, len(MIX))
    from_start = [Sampler(p) for p in MIX]
    want = [sample_batch(step, from_start) for step in logits]
    for k in (1, 7, 29):
        resumed = [Sampler(p, step=k) for p in MIX]
        got = [sample_batch(step, resumed) for step in logits[k:]]
        seeded = [i for i, p in enumerate(MIX) if p.seed is not None and p.temperature > 0]
        assert [[row[i] for i in seeded] for row in got] == [[row[i] for i in seeded] for row in want[k:]]
    assert all(s.step == 30 for s in from_start)


def test_prefill_step_0_then_decode_from_step_1_is_one_run() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    logits = _logits(12, 1)[:, 0]
    one = Sampler(params)
    want = [one.sample(step) for step in logits]
    decode = Sampler(params, step=1)
    assert [Sampler(params).sample(logits[0]), *(decode.sample(step) for step in logits[1:])] == want
    assert len(set(want)) > 1


def test_unseeded_sampling_stays_unseeded() -> None:
    params = SamplingParams(temperature=1.0)
    assert _draws(params, 40) != _draws(params, 40)
    assert Sampler(params, step=3).generator.initial_seed() != Sampler(params, step=3).generator.initial_seed()


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        Sampler(SamplingParams(), step=-1)
