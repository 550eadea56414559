"""Shared helpers for the engine tests: tiny models built once per test process, and oracle checks."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from engine.model import Model, load_model
from engine.tiny import init_tiny_model

ARCHS = ("llama", "qwen2", "gpt2")
NEAR_TIE_GAP = 1e-3


@cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="kvserve-engine-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@cache
def tiny_model_path(arch: str, seed: int = 0) -> Path:
    """A 2-layer, hidden-64 model of ``arch``, written once per test process."""
    return init_tiny_model(_workdir() / f"{arch}-{seed}", arch, seed, layers=2, hidden=64)


@cache
def tiny_model(arch: str) -> Model:
    return load_model(tiny_model_path(arch))


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def top2_gap(logits: torch.Tensor) -> float:
    """Difference between the two largest logits of a [vocab] tensor."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_greedy_matches(
    got: Sequence[int], oracle: Sequence[int], oracle_logits: Sequence[torch.Tensor], gap: float = NEAR_TIE_GAP
) -> None:
    """``got`` equals the oracle's greedy tokens; a mismatch is allowed only at a near-tie step
    (oracle top-2 logit gap < ``gap``), after which the sequences may diverge."""
    for step, (a, b) in enumerate(zip(got, oracle, strict=False)):
        if a != b:
            step_gap = top2_gap(oracle_logits[step])
            assert step_gap < gap, f"step {step}: got {a}, oracle {b}, oracle top-2 gap {step_gap:.2e}"
            return
    assert len(got) >= len(oracle), f"got {len(got)} tokens, oracle {len(oracle)}"
