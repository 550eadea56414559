"""The llama family's forward in kvserve's own code: Llama, Mistral, Qwen2 and Qwen3 (SmolLM is a Llama).

Hugging Face's modules run a decode step's small kernels through layers of Python (modules, hooks, keyword
plumbing, the attention interface, the cache object): on SmolLM2-135M (30 layers) about half of a one-row
step. This forward runs the same arithmetic on the same weights in one loop over the layers, each a dozen
torch calls: fused QKV and gate-up products (engine.packed_linear's packed weights on a CPU), RMSNorm, rotary
embeddings read from a table computed once, the new keys and values written into the paged cache and
paged_attention's ``attend``. In the last layer only the rows whose logits are sampled go past attention.

Every other architecture, and a llama-family model this code does not describe (a rope that changes with the
sequence's length, a module it does not know), runs through Hugging Face's modules (engine.model_runner).
``KVSERVE_MODEL_CODE=hf`` sends every model there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.engine import native
from kvserve.engine.packed_linear import FusedPart, PackedLinear, can_pack, pack
from kvserve.engine.paged_attention import StepBatch, attend, write_kv

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Rope types whose cos and sin depend on the position alone (not on the sequence's length): a table holds them.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")

Linear = Callable[[torch.Tensor], torch.Tensor]


def _plain(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return lambda x: F.linear(x, weight, bias)


def _fused(parts: list[Any]) -> Linear | None:
    """One product for sibling projections: packed_linear's fused weight, or on a device it does not pack, one
    weight whose rows the siblings' parameters become views of (no memory twice). None where they differ."""
    if all(isinstance(p, FusedPart) for p in parts) and len({id(p.fused) for p in parts}) == 1:
        return parts[0].fused.product
    if not all(type(p) is torch.nn.Linear for p in parts) or len({p.bias is None for p in parts}) > 1:
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    lo = 0
    for p in parts:
        hi = lo + p.out_features
        p.weight.data = weight[lo:hi]
        if bias is not None:
            p.bias.data = bias[lo:hi]
        lo = hi
    return _plain(weight, bias)


def _linear(module: Any) -> Linear | None:
    if isinstance(module, PackedLinear):
        return module.product
    if type(module) is torch.nn.Linear:
        return _plain(module.weight, module.bias)
    return None


def _norm(module: Any) -> tuple[torch.Tensor, float] | None:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    return (weight, float(eps)) if isinstance(weight, torch.Tensor) and isinstance(eps, float) else None


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: in float32, then the weight times the result in x's dtype."""
    weight, eps = norm
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same sums as the formula below (one kernel)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: tuple[torch.Tensor, float]
    qkv: Linear
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3's per-head norms of queries and keys
    k_norm: tuple[torch.Tensor, float] | None
    o_proj: Linear
    post_norm: tuple[torch.Tensor, float]
    gate_up: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Linear


def _layer(layer: Any) -> _Layer | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    input_norm, post_norm = _norm(getattr(layer, "input_layernorm", None)), _norm(getattr(layer, "post_attention_layernorm", None))
    qkv = _fused([getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")])
    gate_up = _fused([getattr(mlp, n, None) for n in ("gate_proj", "up_proj")])
    o_proj, down = _linear(getattr(attn, "o_proj", None)), _linear(getattr(mlp, "down_proj", None))
    if input_norm is None or post_norm is None or qkv is None or gate_up is None or o_proj is None or down is None:
        return None
    q_norm, k_norm = _norm(getattr(attn, "q_norm", None)), _norm(getattr(attn, "k_norm", None))
    return _Layer(input_norm, qkv, q_norm, k_norm, o_proj, post_norm, gate_up, mlp.act_fn, down)


class LlamaForward:
    """A step's forward over a packed batch, through the paged cache, for a model of ARCHITECTURES."""

    def __init__(self, hf_model: Any, layers: list[_Layer], lm_head: Linear) -> None:
        config = hf_model.config
        self.embedding = hf_model.get_input_embeddings()  # nn.Embedding, or packed_linear's PackedEmbedding
        self.embed = self.embedding.weight  # (its shape, dtype and device)
        self.layers = layers
        norm = _norm(hf_model.model.norm)
        assert norm is not None  # (checked by `of`)
        self.norm = norm
        self.lm_head = lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.intermediate = config.intermediate_size
        rope = hf_model.model.rotary_emb
        positions = torch.arange(config.max_position_embeddings, device=self.embed.device, dtype=torch.float)
        freqs = positions[:, None] * rope.inv_freq.to(device=self.embed.device, dtype=torch.float)
        half = self.head_dim // 2
        # [positions, head_dim]: cos, and sin with its first half negated, so that x * cos + roll(x) * sin is
        # Hugging Face's x * cos + rotate_half(x) * sin
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rope.attention_scaling).to(self.embed.dtype)
        sin = emb.sin() * rope.attention_scaling
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.embed.dtype)
        on_cpu = self.embed.device.type == "cpu" and self.embed.dtype in native.KERNEL_DTYPES
        self.norm_kernel = native.rms_norm_kernel() if on_cpu else None
        self.rope_store = native.rope_store_kernel() if on_cpu else None

    def _norm(self, x: torch.Tensor | None, residual: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        """residual += x (in place, where x is given), then the RMSNorm of the residual: in one C call where
        the kernels load (torch's rms_norm is half a dozen kernels on a CPU)."""
        if self.norm_kernel is not None:
            return self.norm_kernel(residual if x is None else x, None if x is None else residual, *norm)
        if x is not None:
            residual += x
        return rms_norm(residual, norm)

    @classmethod
    def of(cls, hf_model: Any, head_copy: bool = True) -> LlamaForward | None:
        """The forward for ``hf_model`` (after engine.packed_linear packed it), or None where this code does not
        describe it: another architecture, a rope that depends on the sequence's length, unknown modules.
        ``head_copy``: an LM head tied to the input embedding is packed as a copy of its own (_lm_head)."""
        if os.environ.get("KVSERVE_MODEL_CODE", "") == "hf" or type(hf_model).__name__ not in ARCHITECTURES:
            return None
        inner = getattr(hf_model, "model", None)
        rope = getattr(inner, "rotary_emb", None)
        if inner is None or getattr(rope, "rope_type", None) not in STATIC_ROPE or _norm(getattr(inner, "norm", None)) is None:
            return None
        layers = [_layer(layer) for layer in inner.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        made = hf_model.__dict__.setdefault("_kvserve_forwards", {})  # engines may share a model
        if head_copy not in made:
            lm_head = _lm_head(hf_model, head_copy)
            if lm_head is None:
                return None
            made[head_copy] = cls(hf_model, layers, lm_head)  # type: ignore[arg-type]
        return made[head_copy]

    def _rotary(self, qkv: torch.Tensor, layer: _Layer, positions: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (rotary applied; Qwen3's norms first) and values of ``qkv`` [tokens, heads, head_dim]."""
        h_, kv_, d = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [tokens, 1, head_dim]
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat((rms_norm(qkv[:, :h_], layer.q_norm), rms_norm(qkv[:, h_ : h_ + kv_], layer.k_norm)), 1)
        else:
            qk = qkv[:, : h_ + kv_]
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # rotary, queries and keys at once
        return qk[:, :h_], qk[:, h_:], qkv[:, h_ + kv_ :]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
                 logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [tokens] -> logits [len(logit_rows), vocab] of the rows ``logit_rows``."""
        tokens = input_ids.shape[0]
        h_, kv_, d = self.heads, self.kv_heads, self.head_dim
        residual = self.embedding(input_ids)
        h = self._norm(None, residual, self.layers[0].input_norm)
        last = len(self.layers) - 1
        narrow = logit_rows.numel() < tokens
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h).view(tokens, h_ + 2 * kv_, d)
            if self.rope_store is not None and layer.q_norm is None and batch.cache.kv.device.type == "cpu":
                self.rope_store(qkv, self.cos, self.sin, positions, batch.cache.kv, i, batch.slot_blocks,
                                batch.slot_offsets)  # rotary in place, keys and values into the cache
                q, k, v = qkv[:, :h_], qkv[:, h_ : h_ + kv_], qkv[:, h_ + kv_ :]
            else:
                q, k, v = self._rotary(qkv, layer, positions)
                write_kv(batch, i, k, v)
            if i == last and narrow:
                if not logit_rows.numel():
                    return residual.new_empty(0, self.embed.shape[0])
                residual = residual[logit_rows]
            o = attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], batch,
                       self.scaling)
            if i == last and narrow:
                o = o[logit_rows]  # attend computed these rows alone in the last layer (StepBatch.last_layer)
            gate_up = layer.gate_up(self._norm(layer.o_proj(o.reshape(o.shape[0], h_ * d)), residual, layer.post_norm))
            mlp = layer.down(layer.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
            if i < last:
                h = self._norm(mlp, residual, self.layers[i + 1].input_norm)
            else:
                residual += mlp
        if not narrow:
            residual = residual[logit_rows]
        return self.lm_head(self._norm(None, residual, self.norm))


def _lm_head(hf_model: Any, copy: bool) -> Linear | None:
    """The output projection: packed (for the C kernel a tied one is, its panels read by the embedding too), or
    one tied to the input embedding and left as stored, with ``copy``, packed on its own where oneDNN packs (that
    table's bytes once more: 113 MB on SmolLM2; MKL's product over the table as stored took 10 ms for one row,
    oneDNN's over the packed copy 5 ms, 6.5 against 45 ms for 16 rows)."""
    out = hf_model.get_output_embeddings()
    if copy and type(out) is torch.nn.Linear and isinstance(out.weight, torch.Tensor):
        w = out.weight
        if can_pack(w.device, w.dtype):
            return pack(w, out.bias)
    return _linear(out)
