"""The glue between Hugging Face's model code and the paged KV cache.

One forward runs a packed batch: every token of every sequence in the step side by side
(``input_ids`` of shape ``[1, total_tokens]``, positions per token). Two hooks of transformers
carry it through the unchanged model code:

- ``PagedCache``, given as the model's cache object: each attention layer hands it the new
  keys and values, which it writes into the sequences' cache slots;
- ``paged_attention``, registered as the attention implementation ``kvserve_paged``: it reads
  each sequence's keys and values through its block table and runs SDPA, decode rows (one query
  each) as one batched call and each prompt chunk on its own with its causal offset (on a CPU, both
  through engine.native's kernels, which read the blocks in place).

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

from kvserve.engine import native
from kvserve.engine.kv_cache import KVCache

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


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Where one packed forward writes and reads KV; built once per step, read by every layer."""

    cache: KVCache
    slot_blocks: torch.Tensor  # [tokens] long: the cache block of each new token
    slot_offsets: torch.Tensor  # [tokens] long: its position in that block
    decode_rows: torch.Tensor | None  # [decodes] long: packed index of each single-token sequence
    # [decodes, max_blocks] long, padded with block 0: each decode row's blocks past the shared ones
    decode_tables: torch.Tensor | None
    # [decodes, 1, 1, max_blocks * block_size]: keys in context, bool; additive (0 or -inf) with decode_shared
    decode_mask: torch.Tensor | None
    chunks: tuple[PromptChunk, ...]
    # [blocks] long: the leading blocks every decode row shares (a common system prompt), read once for all
    decode_shared: torch.Tensor | None = None
    shared_kv: SharedPrefixKV | None = None  # those blocks' keys and values, kept across steps
    # [decodes] long: each decode row's tokens in decode_tables, where the rows' attention reads them in place
    # (engine.native, on a CPU; decode_mask is then None)
    decode_lens: torch.Tensor | None = None
    # The model's last layer, where only the rows whose logits are sampled are computed (past it nothing reads
    # the others): a chunk's attention for its sampled last token alone, none for one that samples nothing.
    # Its keys and values are written for every token all the same. -1: every row, as in every layer.
    last_layer: int = -1
    # Prompt chunks' attention reads their context in place (engine.native's chunk kernel, on a CPU; their masks
    # are then None)
    chunks_in_place: bool = False


class PagedCache:
    """The cache object of one packed forward: writes each layer's new K/V into the KV cache."""

    def __init__(self, batch: StepBatch) -> None:
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, kv_heads, tokens, head_dim]
        write_kv(self.batch, layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return key_states, value_states


def write_kv(batch: StepBatch, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write a layer's new keys and values [tokens, kv_heads, head_dim] into their cache slots."""
    batch.cache.layer(layer, 0)[batch.slot_blocks, batch.slot_offsets] = keys
    batch.cache.layer(layer, 1)[batch.slot_blocks, batch.slot_offsets] = values


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


def _shared_prefix_attention(layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, batch: StepBatch, scale: float | None) -> torch.Tensor:
    """Decode attention when every row shares its leading blocks (users over one system prompt): the shared
    keys are gathered and read once, by all rows' queries together, each row's own keys by its query
    alone, and the two parts merged by their log-sum-exp (cascade attention, as FlashInfer does it). At
    4 streams of 2.5k tokens over a 2.3k-token prompt that reads 4.3k keys a layer instead of 10k.
    q: [decodes, kv_heads, heads per kv head, head_dim] -> the same. CPU only (SDPA's flash kernel there
    returns the log-sum-exp)."""
    assert batch.decode_shared is not None and batch.decode_tables is not None and batch.shared_kv is not None
    n, kv_heads, group, d = q.shape
    rows = q.transpose(0, 1).reshape(1, kv_heads, n * group, d)  # every row's queries, per KV head
    if batch.decode_lens is not None:  # engine.native's kernel reads the shared blocks in place, as one row
        kernel = native.decode_kernel()
        assert kernel is not None
        shared_len = batch.decode_shared.new_full((1,), batch.decode_shared.numel() * k_cache.shape[1])
        o_shared, lse_shared = kernel(rows, batch.cache.kv, layer, batch.decode_shared[None], shared_len,
                                      d**-0.5 if scale is None else scale)
    else:
        k_shared, v_shared = batch.shared_kv.get(layer, k_cache, v_cache, batch.decode_shared)
        o_shared, lse_shared = _flash_cpu(rows, k_shared, v_shared, None, scale)
    o_shared = o_shared.reshape(kv_heads, n, group, d).transpose(0, 1)
    lse_shared = lse_shared.reshape(kv_heads, n, group).transpose(0, 1)
    o_own, lse_own = _own_attention(q, k_cache, v_cache, batch, layer, scale)
    lse = torch.logaddexp(lse_shared, lse_own)
    out = (o_shared * torch.exp(lse_shared - lse)[..., None] + o_own * torch.exp(lse_own - lse)[..., None])
    return out.to(q.dtype)


def _own_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch, layer: int,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's attention over its blocks in ``decode_tables``: (output, log-sum-exp), read in place
    by engine.native's kernel where the step has ``decode_lens``, else gathered for SDPA's CPU flash kernel."""
    assert batch.decode_tables is not None
    if batch.decode_lens is not None:  # set where the kernel is built (ModelRunner)
        kernel = native.decode_kernel()
        assert kernel is not None
        return kernel(q, batch.cache.kv, layer, batch.decode_tables, batch.decode_lens,
                      q.shape[-1] ** -0.5 if scale is None else scale)
    tables = batch.decode_tables
    return _flash_cpu(q, _gather(k_cache, tables), _gather(v_cache, tables), batch.decode_mask, scale)


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
    """Hugging Face's attention interface: query [1, heads, tokens, head_dim] -> output [1, tokens, heads,
    head_dim]; plain SDPA without a step."""
    batch: StepBatch | None = kwargs.pop("kvserve_step", None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return attend(int(module.layer_idx), query, key, value, batch, scaling)[None], None  # type: ignore[arg-type]


def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: StepBatch,
           scaling: float | None) -> torch.Tensor:
    """One layer's attention for a step, its new keys and values already written (write_kv): query [1, heads,
    tokens, head_dim], key and value [1, kv_heads, tokens, head_dim] -> [tokens, heads, head_dim]."""
    k_cache, v_cache = batch.cache.layer(layer, 0), batch.cache.layer(layer, 1)
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, head_dim]
    if batch.decode_rows is not None:
        assert batch.decode_tables is not None
        # One query per sequence: the query heads that share a KV head are that head's query rows, so
        # SDPA reads each KV head once instead of repeating it per query head (enable_gqa copies it).
        n, heads, kv_heads, d = batch.decode_rows.numel(), query.shape[1], key.shape[1], query.shape[3]
        # With no prompt chunk every row is a decode row, in order: no indexed gather and scatter (torch runs
        # those on every thread, which stalls a step whenever another process holds a core)
        rows = query[0] if not batch.chunks else query[0, :, batch.decode_rows]
        q = rows.transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, d)
        if batch.decode_shared is not None:
            o = _shared_prefix_attention(layer, q, k_cache, v_cache, batch, scaling)
        elif batch.decode_lens is not None:
            o = _own_attention(q, k_cache, v_cache, batch, layer, scaling)[0]
        else:
            o = scaled_dot_product_attention(
                q, _gather(k_cache, batch.decode_tables), _gather(v_cache, batch.decode_tables),
                attn_mask=batch.decode_mask, scale=scaling,
            )  # [decodes, kv_heads, heads per kv head, head_dim]
        if not batch.chunks:
            return o.reshape(n, heads, d).to(query.dtype)  # the kernels return float32
        out[batch.decode_rows] = o.reshape(n, heads, d).to(out.dtype)
    for c in batch.chunks:
        start, end = c.start, c.start + c.num_tokens
        if layer == batch.last_layer:  # the chunk's rows past this layer: its sampled last one, if any
            out[start:end] = 0
            if not c.sampled:
                continue
            start = end - 1  # which sees every key: no mask
        causal = end - start > 1
        q = query[:, :, start:end]  # [1, heads, n, head_dim]
        if batch.chunks_in_place:
            kernel = native.chunk_kernel()
            assert kernel is not None
            out[start:end] = kernel(q[0].transpose(0, 1), batch.cache.kv, layer, c.block_table, c.context_len,
                                    query.shape[3] ** -0.5 if scaling is None else scaling)
            continue
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
    return out


def install(hf_model: Any) -> None:
    """Make ``hf_model`` run its attention through ``paged_attention`` (plain SDPA without a step)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
