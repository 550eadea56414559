"""Faults injected at the model an Engine runs (``Model.hf_model``), not inside the engine: the tests
that use them hold however the engine drives its model (one forward per sequence, or batched)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kvserve.engine.model import Model


def never(positions: torch.Tensor) -> bool:
    return False


class FaultyForward:
    """Stands in for ``Model.hf_model``: a forward asked to compute any position for which
    ``fails(position_ids)`` holds raises RuntimeError(``message``); any other runs the model unchanged.
    ``fails`` and ``message`` may be changed while the model is in use."""

    def __init__(self, fails: Callable[[torch.Tensor], bool] = never, message: str = "injected fault") -> None:
        self.fails = fails
        self.message = message
        self.num_faults = 0
        self._inner: Any = None

    def around(self, model: Model) -> Model:
        """``model`` with this forward in front of its own."""
        self._inner = model.hf_model
        return replace(model, hf_model=self)

    def forward(self, **kwargs: Any) -> Any:
        positions = kwargs.get("position_ids")
        if positions is not None and self.fails(positions):
            self.num_faults += 1
            raise RuntimeError(self.message)
        return self._inner(**kwargs)

    __call__ = forward

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


def at_position(position: int) -> Callable[[torch.Tensor], bool]:
    """True for a forward that computes ``position`` (of any sequence in it)."""
    return lambda positions: position in positions.flatten().tolist()
