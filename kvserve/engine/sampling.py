"""Token sampling: greedy, temperature, top-k, top-p, with a generator per request, seeded per step."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a request's draw number ``step`` (0: its first token): a pure function of both,
    so any engine can draw step ``k`` without replaying the ``k`` draws before it."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8, person=b"kvserve-sample").digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """One request's sampling: its parameters and its own generator, so the same seed gives the same
    tokens whichever other requests share the batch.

    With a seed, the draw of step ``i`` (``i`` tokens sampled before it) comes from the generator seeded
    with ``step_seed(seed, i)``, so a request gives the same tokens whichever engine samples each step:
    one engine sampling them all (decode computing a prompt itself), prefill the first and decode the
    rest (``step=1``), or a replica continuing a stream another one started (``step`` = the tokens
    already sent). Without a seed, one randomly seeded generator draws every step."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", *, step: int = 0) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.params = params
        self.step = step  # tokens sampled before the next one
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()

    def step_generator(self) -> torch.Generator:
        """The generator for this step's draw: with a seed, seeded from the seed and the step."""
        if self.params.seed is not None:
            self.generator.manual_seed(step_seed(self.params.seed, self.step))
        return self.generator

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id from ``logits`` [vocab]."""
        return sample_batch(logits[None], [self])[0]


def sample_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """Next token of every row of ``logits`` [batch, vocab], row i by ``samplers[i]``; one batched pass
    on the logits' device for all rows, one draw from each sampling row's own generator."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)  # [batch]
    rows = [i for i, s in enumerate(samplers) if s.params.temperature > 0]
    if rows:
        params = [samplers[i].params for i in rows]
        x = logits[rows]  # [rows, vocab]
        x = x / torch.tensor([p.temperature for p in params], device=x.device)[:, None]
        vocab = x.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(top_k) < vocab:
            kth = torch.topk(x, max(top_k), dim=-1).values  # [rows, max_k], descending
            kth = kth.gather(1, torch.tensor(top_k, device=x.device)[:, None] - 1)  # [rows, 1]
            x = x.masked_fill(x < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):  # decided on the host: no wait for the device
            top_p = torch.tensor([p.top_p for p in params], device=x.device)[:, None]  # [rows, 1]
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs >= top_p) & (top_p < 1)
            x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        probs = torch.softmax(x, dim=-1)  # [rows, vocab]
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=samplers[i].step_generator())[0]
    for s in samplers:
        s.step += 1
    return tokens.tolist()
