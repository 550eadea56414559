"""Prefill over the uncached suffix of a prompt, and decode steps, on top of a block-shaped KV cache.

KV blocks have the layout ``[layers, 2, kv_heads, block_size, head_dim]`` (DESIGN.md, "KV block
format"); inside a sequence the engine keeps a Hugging Face ``DynamicCache`` of batch size 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engine.hashing import Namespace
from engine.kv_codec import LeadingBlocks, decode_block, decode_leading
from engine.model import Model, layer_kv


@dataclass(slots=True)
class Sequence:
    """KV state of one sequence, ready for decode: the cache holds the KV of exactly ``token_ids``."""

    token_ids: list[int]
    _cache: DynamicCache | None = field(default=None, repr=False)


@dataclass(slots=True)
class PrefillResult:
    """What one prefill produced; ``new_blocks`` excludes the cached blocks it was given."""

    sequence: Sequence
    new_blocks: list[torch.Tensor]  # each [layers, 2, kv_heads, block_size, head_dim]
    tail: torch.Tensor | None  # [layers, 2, kv_heads, len % block_size, head_dim], None when 0
    logits: torch.Tensor  # [vocab] fp32, at the last prompt position
    num_cached_tokens: int
    num_computed_tokens: int


class StepFailed(RuntimeError):
    """Some sequences of a decode step failed; the others advanced and their ``logits`` rows are valid.

    ``errors`` maps a batch index to its exception; those sequences are left in an undefined state
    and must be released, never decoded again.
    """

    def __init__(self, errors: dict[int, Exception], logits: torch.Tensor) -> None:
        super().__init__(f"{len(errors)} of {len(logits)} sequences failed: "
                         + "; ".join(f"#{i}: {type(e).__name__}: {e}" for i, e in errors.items()))
        self.errors = errors
        self.logits = logits  # [batch, vocab] fp32; rows in ``errors`` are NaN


class Engine:
    """Runs a Model's forward passes over block-shaped KV. One sequence per forward pass for now."""

    def __init__(self, model: Model, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        # Most models can skip the LM head for all but the last position; older ones cannot.
        self._logits_kwargs = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.hf_model.forward).parameters else {}
        )

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace whose root seeds the prefix hashes of this model, dtype and block size."""
        return Namespace(self.model.fingerprint, self.model.kv_dtype_name, self.block_size, cache_salt)

    @torch.inference_mode()
    def prefill(self, token_ids: Seq[int], cached_blocks: Seq[torch.Tensor] = ()) -> PrefillResult:
        """Compute the KV of ``token_ids`` past the ``cached_blocks``, which hold its leading full blocks.

        At least the last token is always computed, for its logits; ValueError if the cached
        blocks cover every token.
        """
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("cannot prefill an empty prompt")
        num_cached = len(cached_blocks) * self.block_size
        if num_cached >= len(tokens):
            raise ValueError(
                f"{len(cached_blocks)} cached blocks cover {num_cached} of {len(tokens)} tokens; "
                "the last prompt token must be computed"
            )
        cache = self._cache_from_blocks(cached_blocks)
        logits = self._forward(cache, tokens[num_cached:], start=num_cached)[0, -1]  # [vocab]
        seq = Sequence(tokens, cache)
        first_new_block = len(cached_blocks)
        num_full = len(tokens) // self.block_size
        tail_start = num_full * self.block_size
        tail = self._kv(cache, tail_start, len(tokens)) if tail_start < len(tokens) else None
        return PrefillResult(
            sequence=seq,
            new_blocks=self.full_blocks(seq, first_new_block),
            tail=tail,
            logits=logits.float(),
            num_cached_tokens=num_cached,
            num_computed_tokens=len(tokens) - num_cached,
        )

    @torch.inference_mode()
    def resume(self, token_ids: Seq[int], blocks: Seq[torch.Tensor], tail: torch.Tensor | None) -> Sequence:
        """KV state for ``token_ids`` from its full blocks plus tail, without a forward pass."""
        tokens = list(token_ids)
        num_tail = 0 if tail is None else tail.shape[3]
        if len(blocks) * self.block_size + num_tail != len(tokens) or num_tail >= self.block_size:
            raise ValueError(
                f"{len(blocks)} blocks of {self.block_size} and a tail of {num_tail} tokens "
                f"do not hold exactly {len(tokens)} tokens"
            )
        return Sequence(tokens, self._cache_from_blocks(blocks, tail))

    def load_leading(self, payloads: Seq[bytes | None], namespace: Namespace) -> LeadingBlocks:
        """Verified full blocks for this model from the start of ``payloads``, up to the first miss or bad one."""
        m = self.model
        return decode_leading(
            payloads, namespace, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            dtype=m.dtype,
        )

    def load_tail(self, payload: bytes, namespace: Namespace, num_tokens: int) -> torch.Tensor:
        """A verified partial block [layers, 2, kv_heads, num_tokens, head_dim]; raises BlockError."""
        m = self.model
        return decode_block(
            payload, namespace, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            dtype=m.dtype, num_tokens=num_tokens,
        )

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence], next_token_ids: list[int]) -> torch.Tensor:
        """Feed one token to each sequence (appending it and its KV); returns logits [batch, vocab] fp32.

        A released sequence is a ValueError before any work. One sequence's failing forward pass does
        not cost the others their step: they advance, and StepFailed carries their logits and the
        failed sequences' errors.
        """
        if len(seqs) != len(next_token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(next_token_ids)} tokens")
        caches = [self._require_cache(seq) for seq in seqs]
        rows: list[torch.Tensor | None] = []
        errors: dict[int, Exception] = {}
        for i, (seq, cache, token) in enumerate(zip(seqs, caches, next_token_ids, strict=True)):
            try:
                rows.append(self._forward(cache, [token], start=len(seq.token_ids))[0, -1].float())  # [vocab]
            except Exception as exc:  # reported per sequence in StepFailed
                errors[i] = exc
                rows.append(None)
                continue
            seq.token_ids.append(token)
        if not errors:
            return torch.stack(rows)  # type: ignore[arg-type]  # [batch, vocab]
        vocab = next((r.shape[0] for r in rows if r is not None), self.model.vocab_size)
        nan = torch.full((vocab,), float("nan"), device=self.model.device)
        raise StepFailed(errors, torch.stack([nan if r is None else r for r in rows]))

    @torch.inference_mode()
    def full_blocks(self, seq: Sequence, start_block: int = 0) -> list[torch.Tensor]:
        """Full blocks of ``seq``'s KV from block index ``start_block`` on, each [L, 2, H, block_size, D]."""
        cache = self._require_cache(seq)
        num_full = len(seq.token_ids) // self.block_size
        if start_block >= num_full:
            return []
        kv = self._kv(cache, start_block * self.block_size, num_full * self.block_size)  # [L, 2, H, n, D]
        return [block.contiguous() for block in kv.split(self.block_size, dim=3)]

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s KV memory; the sequence can no longer be decoded."""
        seq._cache = None

    def _forward(self, cache: DynamicCache, token_ids: list[int], start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` through ``cache``; logits [1, 1, vocab] of the last one."""
        device = self.model.device
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # [1, n]
        position_ids = torch.arange(start, start + len(token_ids), device=device)[None]  # [1, n]
        out = self.model.hf_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=True,
            **{self.model.cache_keyword: cache}, **self._logits_kwargs,
        )
        return out.logits[:, -1:]

    def _cache_from_blocks(self, blocks: Seq[torch.Tensor], tail: torch.Tensor | None = None) -> DynamicCache:
        """A DynamicCache holding the full ``blocks`` and then the ``tail``, checked against the model."""
        m = self.model
        parts = [*blocks, tail] if tail is not None else list(blocks)
        if not parts:
            return DynamicCache(config=m.hf_model.config)
        for i, part in enumerate(parts):
            num_tokens = self.block_size if i < len(blocks) else part.shape[3]
            expected = (m.num_layers, 2, m.num_kv_heads, num_tokens, m.head_dim)
            if tuple(part.shape) != expected or part.dtype != m.dtype:
                raise ValueError(f"block {i}: {part.dtype} {list(part.shape)}, expected {m.dtype} {list(expected)}")
        kv = torch.cat([part.to(m.device) for part in parts], dim=3)  # [L, 2, H, n, D]
        return DynamicCache([(layer[0][None], layer[1][None]) for layer in kv], config=m.hf_model.config)

    def _kv(self, cache: DynamicCache, start: int, end: int) -> torch.Tensor:
        """Tokens ``start:end`` of the cache as [L, 2, H, end - start, D]."""
        layers = [layer_kv(layer) for layer in cache.layers]  # each ([1, H, seq, D], [1, H, seq, D])
        return torch.stack([torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers])

    @staticmethod
    def _require_cache(seq: Sequence) -> DynamicCache:
        if seq._cache is None:
            raise ValueError("sequence was released or never prefilled")
        return seq._cache
