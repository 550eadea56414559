"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request."""

from __future__ import annotations

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


class Sampler:
    """Samples one token at a time for one request; the same seed gives the same tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id from ``logits`` [vocab]."""
        logits = logits.detach().to("cpu", torch.float32)  # [vocab]
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)  # [vocab]
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
            drop = torch.cumsum(probs, dim=-1) - probs >= p.top_p
            logits = logits.index_fill(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [vocab]
        return int(torch.multinomial(probs, 1, generator=self.generator))
