"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request."""

from __future__ import annotations

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


def later_tokens_seed(seed: int) -> int:
    """The seed of every token after a request's first (which is drawn from ``seed`` itself)."""
    return (seed + 1) % 2**64


class Sampler:
    """One request's sampling: its parameters and its own seeded generator, so the same seed gives the
    same tokens whichever other requests share the batch.

    With a seed, the first token is drawn from ``seed`` and the later ones from ``later_tokens_seed(seed)``,
    so a request gives the same tokens whether one engine samples them all (decode computing a prompt
    itself) or prefill samples the first and decode the rest: decode's sampler is then made with
    ``first_token=False``."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", *, first_token: bool = True
                 ) -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        self._later_seed: int | None = None  # reseeds the generator after the first draw
        if params.seed is None:
            self.generator.seed()
        elif first_token:
            self.generator.manual_seed(params.seed)
            self._later_seed = later_tokens_seed(params.seed)
        else:
            self.generator.manual_seed(later_tokens_seed(params.seed))

    def drew(self) -> None:
        """A token was drawn from the generator."""
        if self._later_seed is not None:
            self.generator.manual_seed(self._later_seed)
            self._later_seed = None

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
            tokens[i] = torch.multinomial(probs[j], 1, generator=samplers[i].generator)[0]
            samplers[i].drew()
    return tokens.tolist()
