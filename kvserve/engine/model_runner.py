"""One packed forward for a step's sequences: their scheduled tokens side by side, KV written and read
through their block tables (engine.paged_attention), and a token sampled for each sequence whose
scheduled tokens reach its end."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine import native
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.llama import LlamaForward
from kvserve.engine.model import Model
from kvserve.engine.packed_linear import pack_linear_layers
from kvserve.engine.paged_attention import (
    PagedCache,
    PromptChunk,
    SharedPrefixKV,
    StepBatch,
    chunk_mask,
    install,
)
from kvserve.engine.sampling import sample_batch
from kvserve.engine.sequence import Sequence

MIN_SHARED_BLOCKS = 8  # fewer shared blocks than this are read per row: a second attention call costs more


def shared_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> int:
    """How many leading blocks every decode row's table holds in common (a prompt they share, from the pool's
    prefix cache), when at least MIN_SHARED_BLOCKS and two rows; else 0. Only blocks wholly before each
    row's last token: the block a row writes this step is its own."""
    if len(tables) < 2:
        return 0
    limit = min((length - 1) // block_size for length in lens)
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return n if n >= MIN_SHARED_BLOCKS else 0


class LastLayerRows:
    """Hooks on the MLP of the model's last layer that, within ``only(rows)``, run it over those rows alone
    (the tokens whose logits the step samples) and give zeros for the others, which nothing past the last
    layer reads. With paged_attention's ``StepBatch.last_layer`` this spares a prompt chunk's attention and
    MLP in the last layer but for one row (its projections and norms still run for every row): most of an
    eighth of a chunk's compute in an 8-layer model. One per MLP module (``of``), its rows per thread:
    engines may share a model. An MLP called otherwise than on one [1, tokens, hidden] tensor is left whole."""

    def __init__(self, mlp: torch.nn.Module | None, layer: int) -> None:
        self.layer = layer
        self._step = threading.local()
        if mlp is not None:
            mlp.register_forward_pre_hook(self._narrow)
            mlp.register_forward_hook(self._widen)

    @classmethod
    def of(cls, hf_model: Any) -> LastLayerRows:
        """The hooks of ``hf_model``'s last layer (the highest attention ``layer_idx``, as paged_attention
        counts them), registered once: on the MLP of the module that holds that attention."""
        layer = max((m.layer_idx for m in hf_model.modules() if isinstance(getattr(m, "layer_idx", None), int)),
                    default=-1)
        mlp = next((m.mlp for m in hf_model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)
                    and any(getattr(c, "layer_idx", None) == layer for c in m.children())), None)
        if mlp is None:
            return cls(None, layer)  # attention alone is narrowed
        rows = mlp.__dict__.get("_kvserve_last_layer_rows")
        if rows is None:
            rows = mlp.__dict__["_kvserve_last_layer_rows"] = cls(mlp, layer)
        return rows

    @contextlib.contextmanager
    def only(self, rows: torch.Tensor) -> Iterator[None]:
        self._step.rows = rows
        try:
            yield
        finally:
            self._step.rows = None

    def _narrow(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        rows = getattr(self._step, "rows", None)
        self._step.shape = None
        if rows is None or len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            return None
        self._step.shape = tuple(args[0].shape)  # [1, tokens, hidden]
        return (args[0][:, rows],)

    def _widen(self, module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> torch.Tensor | None:
        shape = getattr(self._step, "shape", None)
        if shape is None:
            return None
        self._step.shape = None
        full = out.new_zeros((*shape[:-1], out.shape[-1]))
        full[:, self._step.rows] = out
        return full


@dataclass(slots=True)
class _Forward:
    """The inputs of one packed forward and which rows of its logits are sampled."""

    batch: StepBatch
    input_ids: torch.Tensor  # [1, tokens]
    positions: torch.Tensor  # [1, tokens]
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Model, cache: KVCache, head_copy: bool = True) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        install(model.hf_model)
        pack_linear_layers(model.hf_model)  # once, and before the first forward (engine.packed_linear)
        self.forward = LlamaForward.of(model.hf_model, head_copy)  # None: Hugging Face's modules run the step
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.hf_model.forward).parameters
        # A ready 4D mask makes the model skip building one; paged_attention does its own masking.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=model.device)
        self.shared_kv = SharedPrefixKV(max_bytes=cache.kv.nbytes // 4)
        self.attention = native.attention_kernel(cache.kv.device.type, cache.kv.dtype)  # what decode rows run
        self.in_place_decode = self.attention.name != native.SDPA
        # prompt chunks too, where the kernel takes the head size
        self.in_place_chunks = native.chunk_kernel() is not None and self.in_place_decode and model.head_dim % 16 == 0
        self.last_layer_rows = LastLayerRows.of(model.hf_model) if self.forward is None else None
        self.last_layer = model.num_layers - 1 if self.last_layer_rows is None else self.last_layer_rows.layer

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """Compute the KV of each sequence's next ``n`` tokens in one forward; the token sampled for each
        sequence whose tokens are now all computed (keeping its logits if it asks)."""
        fwd = self._prepare(scheduled)
        m = self.model
        rows = torch.tensor(fwd.logit_rows, dtype=torch.long, device=m.device)
        if self.forward is not None:
            logits = self.forward(fwd.input_ids[0], fwd.positions[0], fwd.batch, rows)
        else:
            logits = self._hf_forward(fwd, rows)
        if not fwd.sampled:
            return {}
        tokens = sample_batch(logits, [s.sampler for s in fwd.sampled])
        for seq, row in zip(fwd.sampled, logits, strict=True):
            if seq.keep_logits:
                seq.logits = row.float()
        return dict(zip(fwd.sampled, tokens, strict=True))

    def _hf_forward(self, fwd: _Forward, rows: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits through Hugging Face's modules, paged_attention as their attention."""
        m = self.model
        kwargs = {"logits_to_keep": rows} if self._logits_to_keep else {}
        assert self.last_layer_rows is not None
        with self.last_layer_rows.only(rows) if fwd.batch.last_layer >= 0 else contextlib.nullcontext():
            out = m.hf_model(
                input_ids=fwd.input_ids, position_ids=fwd.positions, attention_mask=self._no_mask, use_cache=True,
                kvserve_step=fwd.batch, **{m.cache_keyword: PagedCache(fwd.batch)}, **kwargs,
            )
        return out.logits[0] if self._logits_to_keep else out.logits[0, rows]

    def shared_key(self, seq: Sequence, n: int) -> tuple[object, ...] | None:
        """What names the first ``n`` blocks of ``seq`` and their contents (SharedPrefixKV), or None when they
        are not to be kept: unhashed (never shared through the pool), or too large."""
        if len(seq.block_hashes) < n or self.cache.block_bytes * n > self.shared_kv.max_bytes:
            return None
        return (*seq.block_table[:n], seq.block_hashes[n - 1])

    def _prepare(self, scheduled: list[tuple[Sequence, int]]) -> _Forward:
        bs, device = self.block_size, self.model.device
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_seqs: list[Sequence] = []
        chunks: list[PromptChunk] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in scheduled:
            start, end, row = seq.num_computed_tokens, seq.num_computed_tokens + n, len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table[: -(-end // bs)]
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
                decode_seqs.append(seq)
            else:
                block_table, sampled_here = torch.tensor(table, device=device), end == len(seq.token_ids)
                mask = None if self.in_place_chunks else chunk_mask(start, end, device)
                chunks.append(PromptChunk(row, n, end, block_table, mask, sampled_here))
            if end == len(seq.token_ids):
                logit_rows.append(row + n - 1)
                sampled.append(seq)
        pos = torch.tensor(positions, device=device)
        decode, shared = self._decode_inputs(decode_rows, decode_tables, decode_lens, decode_seqs)
        batch = StepBatch(
            cache=self.cache,
            slot_blocks=torch.tensor(slot_blocks, device=device),
            slot_offsets=pos % bs,
            decode_rows=decode[0] if decode else None,
            decode_tables=decode[1] if decode else None,
            decode_mask=decode[2] if decode else None,
            chunks=tuple(chunks),
            decode_shared=shared,
            shared_kv=self.shared_kv,
            decode_lens=decode[3] if decode and self.in_place_decode else None,
            last_layer=self.last_layer if len(logit_rows) < len(ids) else -1,
            chunks_in_place=self.in_place_chunks,
        )
        return _Forward(batch, torch.tensor([ids], device=device), pos[None], logit_rows, sampled)

    def _decode_inputs(
        self, rows: list[int], tables: list[list[int]], lens: list[int], seqs: list[Sequence],
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None, torch.Tensor | None]:
        """The decode rows' (rows, padded block tables, mask, lengths), None without decode rows; and the blocks
        they share when read apart (shared_blocks), else None."""
        bs, device = self.block_size, self.model.device
        n = shared_blocks(tables, lens, bs) if rows and device.type == "cpu" else 0
        if not self.in_place_decode:  # (engine.native's kernel reads the shared blocks where they lie)
            self.shared_kv.use(self.shared_key(seqs[0], n) if n else None)  # None: what was kept goes
        if not rows:
            return None, None
        shared = None
        if n:
            shared = torch.tensor(tables[0][:n], device=device)
            tables = [t[n:] for t in tables]
            lens = [length - n * bs for length in lens]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        lengths = torch.tensor(lens, device=device)
        mask = None
        if not self.in_place_decode:
            mask = (torch.arange(width * bs, device=device)[None, :] < lengths[:, None])[:, None, None, :]
            if n:  # the CPU flash kernel's additive mask, in the query's dtype
                mask = torch.zeros(mask.shape, dtype=self.cache.kv.dtype,
                                   device=device).masked_fill(~mask, -torch.inf)
        return (torch.tensor(rows, device=device), padded, mask, lengths), shared
