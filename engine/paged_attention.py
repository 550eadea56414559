"""The glue between Hugging Face's model code and the paged KV cache.

One forward runs a packed batch: every token of every sequence in the step side by side
(``input_ids`` of shape ``[1, total_tokens]``, positions per token). Two hooks of transformers
carry it through the unchanged model code:

- ``PagedCache``, given as the model's cache object: each attention layer hands it the new
  keys and values, which it writes into the sequences' cache slots;
- ``paged_attention``, registered as the attention implementation ``kvserve_paged``: it reads
  each sequence's keys and values through its block table and runs SDPA, decode rows (one query
  each) as one batched call and each prompt chunk on its own with its causal offset. On a CPU the
  blocks every decode row shares (SharedPrefixKV) and each row's own (OwnKV) are kept contiguous
  between steps, so that a step does not gather them again.

Called without a step (Hugging Face ``generate`` on the same model, the oracle), the attention
is plain SDPA with the usual masks. Hugging Face's own ``PagedAttentionCache`` is not used: its
continuous-batching manager owns block allocation and sampling and cannot take KV computed
elsewhere (the store), which is the point of kvserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "kvserve_paged"


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """Tokens ``start:start + num_tokens`` of the packed batch: one sequence's prompt chunk, whose last
    token sits at context position ``context_len - 1``."""

    start: int
    num_tokens: int
    context_len: int
    block_table: torch.Tensor  # [blocks] long
    # [num_tokens, context_len] bool, query i seeing keys 0 .. context_len - num_tokens + i; None: that causal
    # mask aligned to the lower right, applied by the kernel (see chunk_mask)
    mask: torch.Tensor | None
    sampled: bool = False  # the step samples a token from its last token's logits (the prompt's end)


class SharedPrefixKV:
    """The keys and values of the leading blocks every decode row shares (a system prompt), gathered into
    contiguous tensors by the first step that reads them and kept for the steps after, while the rows
    share the same blocks: a step then gathers only each row's own blocks, and SDPA reads the shared keys
    contiguously. At 4 streams over a 2.3k-token prompt that spared 2.3k of 3.1k keys' gather a layer.

    ``key`` names the blocks and what they hold (their ids, and the prefix hash of the last, which the
    pool keeps with that block while any row holds it): blocks freed and given to another prompt get
    another key. One set at a time, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.key: tuple[object, ...] | None = None
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def use(self, key: tuple[object, ...] | None) -> None:
        """This step's shared blocks (None: not to be kept)."""
        if key != self.key:
            self.key = key
            self._layers.clear()

    def get(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
            blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, kv_heads, blocks * block_size, head_dim] keys and values of ``blocks`` in ``layer``."""
        kv = self._layers.get(layer)
        if kv is None:
            table = blocks[None]
            kv = _gather(k_cache, table).contiguous(), _gather(v_cache, table).contiguous()
            if self.key is not None:
                self._layers[layer] = kv
        return kv


MIN_SLOTS, MIN_TOKENS = 8, 256  # OwnKV's smallest tensor: rows, and tokens a row


class OwnKV:
    """Each decode row's own keys and values (its tokens past the blocks every row shares), kept contiguous
    from one step to the next, so that a step reads them in place instead of gathering them from the pool's
    blocks: a row that decoded in the previous step only appends its new token. At 11 streams of 750-900 own
    tokens the gather was a quarter of a decode step, and SDPA read what it had just copied.

    One tensor [layers, 2, slots, kv_heads, capacity, head_dim]: the step's rows in slots ``0 .. rows - 1``,
    in the order ``prepare`` gives them. A row that joins (its prompt just computed, back after a step
    without it, or when the number of shared blocks changed, which moves where its own tokens start) is
    copied in from the pool once; a row that stays keeps its slot, but one past the number kept, which moves
    into the slot of a row that left (so a row leaving costs one copy, not a shift of those after it). Past a
    row's tokens its slot holds zeros (cleared as far as an earlier row wrote): the mask hides those keys,
    but a NaN left there by another row would still turn the row's output into NaN. It grows with headroom
    up to ``max_bytes`` (for a moment, while the rows are copied into a larger one, both are held) and is
    kept once grown; a step whose rows need more gathers them as before. CPU only, as SharedPrefixKV."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.buf: torch.Tensor | None = None
        self.base = 0  # the shared blocks that the rows' own tokens follow
        self.seqs: list[int] = []  # the sequence in each slot, as of the latest step
        self.lens: list[int] = []  # its own tokens there after that step
        self.width = 0  # this step's longest row
        self._slots: torch.Tensor | None = None  # this step's rows: their slots and the new token's place
        self._positions: torch.Tensor | None = None
        self._written: list[int] = []  # per slot: past this, zeros (rows wrote only below it)

    def drop(self) -> None:
        """No row is kept (a step without decode rows: a row decoding after it may have been recomputed)."""
        self.seqs, self.lens = [], []

    def prepare(self, cache: KVCache, seqs: list[int], tables: list[list[int]], lens: list[int],
                base: int) -> list[int] | None:
        """Slots for this step's decode rows (sequence ids ``seqs``; their blocks past ``base`` shared ones, and
        their own tokens, this step's included): the rows' indices in slot order, or None when they do not fit
        ``max_bytes`` (nothing kept). Rows that decoded in the previous step keep their keys and values (those
        past the kept rows' count moved into the slots of rows gone); the others are copied in."""
        if base != self.base:
            self.base = base
            self.drop()
        if not self._fit(cache, len(seqs), max(lens)):
            self.drop()
            return None
        assert self.buf is not None
        slot_of = {seq: slot for slot, seq in enumerate(self.seqs)}
        kept = [i for i, seq in enumerate(seqs) if seq in slot_of and self.lens[slot_of[seq]] == lens[i] - 1]
        self.drop()  # until the slots below are filled: a failure half-way keeps nothing
        # the kept rows in slots 0 .. kept - 1: each in the slot it holds, but a row past them, which moves into the
        # slot of a row gone (one copy); then the rows joining, copied in from the pool
        order: list[int] = [-1] * len(kept)
        movers = []
        for i in kept:
            held = slot_of[seqs[i]]
            if held < len(kept):
                order[held] = i
            else:
                movers.append(i)
        free = [slot for slot, i in enumerate(order) if i < 0]
        for slot, i in zip(free, movers, strict=True):
            held = slot_of[seqs[i]]
            end = max(self._written[held], self._written[slot])
            self.buf[:, :, slot, :, :end] = self.buf[:, :, held, :, :end]
            self._written[slot] = self._written[held]
            order[slot] = i
        kept_set = set(kept)
        joined = [i for i in range(len(seqs)) if i not in kept_set]
        for slot, i in enumerate(joined, start=len(order)):
            self._copy_in(cache, slot, tables[i], lens[i] - 1)
        order += joined
        self.seqs, self.lens = [seqs[i] for i in order], [lens[i] for i in order]
        for slot, length in enumerate(self.lens):  # this step writes each row's token at length - 1
            self._written[slot] = max(self._written[slot], length)
        self.width = max(lens)
        device = self.buf.device
        self._slots = torch.arange(len(order), device=device)
        self._positions = torch.tensor(self.lens, device=device) - 1
        return order

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the rows' new keys and values ([kv_heads, rows, head_dim], in slot order) in ``layer``; its
        keys and values of every row: [rows, kv_heads, width, head_dim] each."""
        assert self.buf is not None
        rows = len(self.seqs)
        k, v = self.buf[layer, 0], self.buf[layer, 1]  # [slots, kv_heads, capacity, head_dim]
        k[self._slots, :, self._positions] = key.transpose(0, 1)
        v[self._slots, :, self._positions] = value.transpose(0, 1)
        return k[:rows, :, : self.width], v[:rows, :, : self.width]

    def _fit(self, cache: KVCache, rows: int, width: int) -> bool:
        """Room for ``rows`` rows of ``width`` tokens: the dimension short of it doubles (to MIN_SLOTS slots and
        MIN_TOKENS tokens at least; by a quarter when that would pass ``max_bytes``), the kept rows copied over:
        a few reallocations while streams start and grow, not one every few steps. False when even that passes
        ``max_bytes``: the step gathers."""
        _, layers, _, bs, heads, dim = cache.kv.shape
        have_slots, have_capacity = (self.buf.shape[2], self.buf.shape[4]) if self.buf is not None else (0, 0)
        if rows <= have_slots and width <= have_capacity:
            return True
        per_slot_token = layers * 2 * heads * dim * cache.kv.dtype.itemsize
        for grow, least_slots, least_tokens in ((2.0, MIN_SLOTS, MIN_TOKENS), (1.25, 0, 0)):
            slots = have_slots if rows <= have_slots else max(rows, int(have_slots * grow), least_slots)
            capacity = have_capacity if width <= have_capacity else max(width, int(have_capacity * grow), least_tokens)
            capacity = -(-capacity // bs) * bs
            if slots * capacity * per_slot_token <= self.max_bytes:
                break
        else:
            return False
        buf = torch.zeros((layers, 2, slots, heads, capacity, dim), dtype=cache.kv.dtype, device=cache.kv.device)
        if self.buf is not None:
            buf[:, :, :have_slots, :, :have_capacity] = self.buf
        self.buf = buf
        self._written += [0] * (slots - have_slots)
        return True

    def _copy_in(self, cache: KVCache, slot: int, table: list[int], num_tokens: int) -> None:
        """The first ``num_tokens`` own tokens of a row, from its blocks in the pool, into ``slot``; zeros after,
        as far as another row wrote there."""
        assert self.buf is not None
        bs = cache.block_size
        blocks = -(-num_tokens // bs)
        if blocks:
            src = cache.kv.index_select(0, torch.tensor(table[:blocks], device=cache.kv.device))
            # [blocks, layers, 2, bs, heads, dim] -> [layers, 2, heads, blocks, bs, dim], one copy
            self.buf[:, :, slot, :, : blocks * bs].unflatten(3, (blocks, bs)).copy_(src.permute(1, 2, 4, 0, 3, 5))
        end = max(blocks * bs, self._written[slot])
        self.buf[:, :, slot, :, num_tokens:end] = 0
        self._written[slot] = num_tokens


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Where one packed forward writes and reads KV; built once per step, read by every layer."""

    cache: KVCache
    slot_blocks: torch.Tensor  # [tokens] long: the cache block of each new token
    slot_offsets: torch.Tensor  # [tokens] long: its position in that block
    decode_rows: torch.Tensor | None  # [decodes] long: packed index of each single-token sequence
    # [decodes, max_blocks] long, padded with block 0: each decode row's blocks past the shared ones; None when
    # own_kv holds their keys and values
    decode_tables: torch.Tensor | None
    # [decodes, 1, 1, keys]: keys in context, bool; additive (0 or -inf) with decode_shared. keys: max_blocks *
    # block_size, or own_kv.width
    decode_mask: torch.Tensor | None
    chunks: tuple[PromptChunk, ...]
    # [blocks] long: the leading blocks every decode row shares (a common system prompt), read once for all
    decode_shared: torch.Tensor | None = None
    shared_kv: SharedPrefixKV | None = None  # those blocks' keys and values, kept across steps
    own_kv: OwnKV | None = None  # the decode rows' own keys and values, kept across steps (their order)
    # The model's last layer, where only the rows whose logits are sampled are computed (past it nothing reads
    # the others): a chunk's attention for its sampled last token alone, none for one that samples nothing.
    # Its keys and values are written for every token all the same. -1: every row, as in every layer.
    last_layer: int = -1


class PagedCache:
    """The cache object of one packed forward: writes each layer's new K/V into the KV cache."""

    def __init__(self, batch: StepBatch) -> None:
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        # key_states, value_states: [1, kv_heads, tokens, head_dim] -> slots [tokens, kv_heads, head_dim]
        b.cache.layer(layer_idx, 0)[b.slot_blocks, b.slot_offsets] = key_states[0].transpose(0, 1)
        b.cache.layer(layer_idx, 1)[b.slot_blocks, b.slot_offsets] = value_states[0].transpose(0, 1)
        return key_states, value_states


def chunk_mask(start: int, end: int, device: torch.device) -> torch.Tensor | None:
    """The mask of a prompt chunk of positions ``start .. end - 1`` over keys ``0 .. end - 1``, or None: when
    the chunk is the whole context (plain causal), and on CUDA, where SDPA's flash and memory-efficient
    kernels align the causal mask to the lower right themselves. A mask tensor there keeps SDPA off its flash
    kernel, and with grouped-query heads sends it to its math kernel and [heads, n, context] float scores
    (the second 8k chunk of a 16k prompt: 6 GiB). On a CPU that path warns and builds the mask at every layer,
    so it is built here, once per step."""
    # flash-attn's kernel with block tables would also spare the gather of the context's KV; not installed.
    if start == 0 or device.type == "cuda":
        return None
    return torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]  # [n, end]


def _gather(cache_layer: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads, blocks * block_size, head_dim] from cache slots [blocks, block_size, kv_heads, head_dim]."""
    b, n = tables.shape
    num_blocks, bs, h, d = cache_layer.shape
    # Rows of a 2-D view: on a CPU, index_select copies each row in one go, 4-5x faster than over the
    # 4-D view (which it walks element-wise): at 4 streams of 2.5k tokens it was half of a decode step.
    blocks = cache_layer.view(num_blocks, bs * h * d).index_select(0, tables.view(-1))  # [batch * blocks, slot]
    return blocks.view(b, n * bs, h, d).transpose(1, 2)


def _shared_prefix_attention(module: torch.nn.Module, q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, batch: StepBatch,
                             scale: float | None) -> torch.Tensor:
    """Decode attention when every row shares its leading blocks (users over one system prompt): the shared
    keys are gathered and read once, by all rows' queries together, each row's own keys by its query
    alone, and the two parts merged by their log-sum-exp (cascade attention, as FlashInfer does it). At
    4 streams of 2.5k tokens over a 2.3k-token prompt that reads 4.3k keys a layer instead of 10k.
    q: [decodes, kv_heads, heads per kv head, head_dim], k_own and v_own: [decodes, kv_heads, keys, head_dim] ->
    the same as q. CPU only (SDPA's flash kernel there returns the log-sum-exp)."""
    assert batch.decode_shared is not None and batch.shared_kv is not None
    n, kv_heads, group, d = q.shape
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_shared, v_shared = batch.shared_kv.get(layer, k_cache, v_cache, batch.decode_shared)
    rows = q.transpose(0, 1).reshape(1, kv_heads, n * group, d)  # every row's queries, per KV head
    o_shared, lse_shared = _flash_cpu(rows, k_shared, v_shared, None, scale)
    o_shared = o_shared.reshape(kv_heads, n, group, d).transpose(0, 1)
    lse_shared = lse_shared.reshape(kv_heads, n, group).transpose(0, 1)
    o_own, lse_own = _flash_cpu(q, k_own, v_own, batch.decode_mask, scale)
    lse = torch.logaddexp(lse_shared, lse_own)
    out = (o_shared * torch.exp(lse_shared - lse)[..., None] + o_own * torch.exp(lse_own - lse)[..., None])
    return out.to(q.dtype)


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel: (output [batch, heads, queries, head_dim], log-sum-exp [batch, heads, queries])."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                     scale=scale)
    return out[0], out[1]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, tokens, head_dim] -> output [1, tokens, heads, head_dim]."""
    batch: StepBatch | None = kwargs.pop("kvserve_step", None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache, v_cache = batch.cache.layer(layer, 0), batch.cache.layer(layer, 1)
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, head_dim]
    if batch.decode_rows is not None:
        # One query per sequence: the query heads that share a KV head are that head's query rows, so
        # SDPA reads each KV head once instead of repeating it per query head (enable_gqa copies it).
        n, heads, kv_heads, d = batch.decode_rows.numel(), query.shape[1], key.shape[1], query.shape[3]
        q = query[0, :, batch.decode_rows].transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, d)
        if batch.own_kv is not None:
            k_own, v_own = batch.own_kv.update(layer, key[0, :, batch.decode_rows], value[0, :, batch.decode_rows])
        else:
            assert batch.decode_tables is not None
            k_own, v_own = _gather(k_cache, batch.decode_tables), _gather(v_cache, batch.decode_tables)
        if batch.decode_shared is not None:
            o = _shared_prefix_attention(module, q, k_cache, v_cache, k_own, v_own, batch, scaling)
        else:  # [decodes, kv_heads, heads per kv head, head_dim]
            o = scaled_dot_product_attention(q, k_own, v_own, attn_mask=batch.decode_mask, scale=scaling)
        out[batch.decode_rows] = o.reshape(n, heads, d)
    for c in batch.chunks:
        start, end = c.start, c.start + c.num_tokens
        if layer == batch.last_layer:  # the chunk's rows past this layer: its sampled last one, if any
            out[start:end] = 0
            if not c.sampled:
                continue
            start = end - 1  # which sees every key: no mask
        causal = end - start > 1
        q = query[:, :, start:end]  # [1, heads, n, head_dim]
        if c.context_len == c.num_tokens:  # no earlier context: the chunk's own keys, causal
            k, v = key[:, :, c.start : end], value[:, :, c.start : end]
            o = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=gqa)
        else:
            table = c.block_table[None]
            k = _gather(k_cache, table)[:, :, : c.context_len]  # [1, kv_heads, context, head_dim]
            v = _gather(v_cache, table)[:, :, : c.context_len]
            mask = (c.mask if c.mask is not None else causal_lower_right(c.num_tokens, c.context_len)) if causal else None
            o = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out[None], None


def install(hf_model: Any) -> None:
    """Make ``hf_model`` run its attention through ``paged_attention`` (plain SDPA without a step)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
