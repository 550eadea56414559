"""Linear layers whose weights are reordered once, at start, into a layout made for this CPU's product: panels
for kvserve's C kernel (engine.native: float32; bfloat16 beside oneDNN's copy, TwoCopies), else oneDNN's blocked
layout (no kernel here).

torch's ``nn.Linear`` on a CPU calls MKL's GEMM with the weight as stored, and a decode step's few rows
against a weight matrix are bound by how fast that matrix streams in: measured here (one core, the tiny
model's 24 weight matrices of 2048 x 512), 11.0 ms for 4 rows as stored, 3.6 ms prepacked; 43.6 against
16.7 ms for 64 rows, 157 against 56 ms for 256. vLLM's CPU build runs its linear layers through oneDNN. On
SmolLM2-135M's weights (2 cores) the C kernel's product takes 19.2 ms for one row where oneDNN's takes 28.5
(25.4 against 32.4 ms for 16 rows; about even from 512). The results differ from MKL's in the last bits (a
different order of the same fp32 sums), as any other kernel's would: greedy tokens match Hugging Face's but
where its top two logits all but tie.

The engine packs the model it runs (engine.model_runner); a Hugging Face forward of the same model object
then runs through these layers too, so an oracle must load the model on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvserve.engine import native

PACKED_DTYPES = (torch.float32, torch.bfloat16)
FEW_ROWS = 4  # TwoCopies
Product = Callable[[torch.Tensor], torch.Tensor]


def has_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's linear kernels for ``device`` and ``dtype`` on this CPU (fp32, or bf16 where
    the CPU has its instructions)."""
    if not (device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # bf16 needs AVX-512 (or AVX-NE-CONVERT): elsewhere oneDNN refuses it, and MKL's path stays
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C kernel's product takes weights on ``device`` in ``dtype`` (float32 or bfloat16 on a CPU, kernel
    loaded)."""
    return device.type == "cpu" and dtype in native.KERNEL_DTYPES and native.linear_kernel() is not None


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack`` has a product for weights on ``device`` in ``dtype``: the C kernel's (float32 on a CPU),
    or oneDNN's (fp32, or bf16 where the CPU has its instructions)."""
    return _native(device, dtype) or has_onednn(device, dtype)


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """x -> x @ weight.T + bias, over a copy of ``weight`` packed for this CPU (see ``can_pack``); a bfloat16 one
    where both products take it, over two copies (TwoCopies)."""
    kernel = native.linear_kernel()
    few = kernel(weight, bias) if kernel is not None and _native(weight.device, weight.dtype) else None
    if few is not None and (weight.dtype == torch.float32 or not has_onednn(weight.device, weight.dtype)):
        return few
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def wide(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return wide if few is None else TwoCopies(few, wide)


class TwoCopies:
    """A bfloat16 weight held twice: a product of at most FEW_ROWS rows (a decode step) streams the C kernel's
    panels, widened to float32 as they are read; more rows (a prompt) go through oneDNN's copy, whose bfloat16
    instructions compute twice as many products a cycle as float32 ones. On SmolLM2's weights in bfloat16 (2
    cores, AVX-512 BF16): one row 6.8-9.9 ms on the panels, 14.8 on oneDNN's; 4 rows 10.2-10.6 against 13.2; about
    even at 6 to 8; 16 rows 30.6 against 18.5-22.7."""

    def __init__(self, few: native.PanelLinear, wide: Product) -> None:
        self.few, self.wide = few, wide

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.few(x) if x.numel() <= FEW_ROWS * x.shape[-1] else self.wide(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.few.rows(ids)


def _stand_in(weight: torch.Tensor) -> torch.Tensor:
    """A tensor with ``weight``'s shape, dtype and device and no data of its own (the packed copy holds it)."""
    return torch.empty((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a packed weight (``product``); ``weight`` stands for the layer's in shape,
    dtype and device, with no data of its own."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = pack(linear.weight, linear.bias)
        self.weight = _stand_in(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# Sibling layers that read the same input, by the names Hugging Face's Llama, Mistral, Qwen and Gemma give
# them: packed as one weight, as vLLM's QKVParallelLinear and MergedColumnParallelLinear hold them.
FUSED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Fused:
    """Sibling linear layers packed as one weight, their output features side by side. The first of them
    called on an input computes every sibling's output in one product; a sibling called on that same tensor
    before its parent's call returns takes its columns of it (another input gets a product of its own; no
    Hugging Face attention or MLP writes its input between the siblings' calls). One
    product of 1,024 features costs about what the largest of three (512, 256, 256) did: the tiny model, one
    row, 8 layers, 0.86 against 1.67 ms. What a thread computed is its own: engines may share a model."""

    def __init__(self, parent: torch.nn.Module, linears: list[torch.nn.Linear]) -> None:
        with torch.no_grad():
            biases = [m.bias for m in linears]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
            self.product = pack(torch.cat([m.weight.detach() for m in linears]), self.bias)
        self._last = threading.local()
        parent.register_forward_hook(self._forget)  # holds no tensor past the parent's call

    def _forget(self, *_: Any) -> None:
        self._last.x = self._last.y = None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        if getattr(last, "x", None) is not x:
            last.x, last.y = x, self.product(x)
        return last.y


class FusedPart(torch.nn.Module):
    """One sibling of a ``_Fused`` group: its columns of the group's product. ``weight`` stands for the layer's
    weight in shape, dtype and device, with no data of its own (the group's packed one holds it), and ``bias``
    is the layer's rows of the group's."""

    def __init__(self, fused: _Fused, linear: torch.nn.Linear, lo: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fused, self.lo, self.hi = fused, lo, lo + linear.out_features
        self.weight = _stand_in(linear.weight)
        self.bias = None if fused.bias is None else fused.bias[self.lo : self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(x)[..., self.lo : self.hi]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _fuse(parent: torch.nn.Module) -> int:
    """Replace the FUSED_NAMES siblings of ``parent`` by FusedParts where they are plain linear layers that
    agree in input size, dtype and bias; how many were replaced."""
    replaced = 0
    for names in FUSED_NAMES:
        linears = [m for name in names if type(m := getattr(parent, name, None)) is torch.nn.Linear]
        if len(linears) < len(names) or len({(m.in_features, m.weight.dtype, m.bias is None) for m in linears}) > 1:
            continue
        if linears[0].weight.dtype not in PACKED_DTYPES:
            continue
        fused, lo = _Fused(parent, linears), 0
        for name, m in zip(names, linears, strict=True):
            setattr(parent, name, FusedPart(fused, m, lo))
            lo += m.out_features
        replaced += len(names)
    return replaced


def pack_linear_layers(hf_model: Any) -> int:
    """Replace every ``nn.Linear`` of ``hf_model`` with a PackedLinear (siblings that read the same input with
    FusedParts of one weight); how many were replaced. An output embedding that shares its weight with the input
    embedding (tied) is packed only for the C kernel, whose panels the input embedding then reads too
    (PackedEmbedding: the table held once); elsewhere it is left alone, the embedding still reading it. Nothing
    where ``can_pack`` says no."""
    params = next(hf_model.parameters(), None) if isinstance(hf_model, torch.nn.Module) else None
    if params is None or not can_pack(params.device, params.dtype):  # not a model (a test's stand-in)
        return 0
    out, inp = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    tied = (type(out) is torch.nn.Linear and inp is not None
            and out.weight.data_ptr() == inp.weight.data_ptr())  # (a second engine on the model finds it packed)
    share = (tied and type(inp) is torch.nn.Embedding and inp.max_norm is None
             and _native(out.weight.device, out.weight.dtype))
    replaced = 0
    for parent in list(hf_model.modules()):
        replaced += _fuse(parent)
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.Linear and (share or not (tied and child is out))
                    and child.weight.dtype in PACKED_DTYPES):
                setattr(parent, name, packed := PackedLinear(child))
                replaced += 1
                if share and child is out:
                    _replace(hf_model, inp, PackedEmbedding(inp, packed.product))
    if replaced:
        _own_copies(hf_model)
    return replaced


def _replace(root: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)


class PackedEmbedding(torch.nn.Module):
    """An input embedding tied to the output projection, read from that projection's panels (native.PanelLinear):
    the table is held once. ``weight`` stands for the table in shape, dtype and device, with no data of its own."""

    def __init__(self, embedding: torch.nn.Embedding, panels: Any) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.panels = panels
        self.weight = _stand_in(embedding.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.panels.rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _own_copies(hf_model: torch.nn.Module) -> None:
    """The parameters and buffers left as they were loaded (embeddings, norms) copied into this process's own
    memory: loaded from safetensors they are views of the file's mapping, which then stayed resident whole, the
    packed layers' originals included (on SmolLM2, 525 MB beside the 420 MB packed). Once nothing views it, the
    mapping goes."""
    with torch.no_grad():
        for tensor in [*hf_model.parameters(), *hf_model.buffers()]:
            if tensor.layout == torch.strided:
                tensor.data = tensor.data.clone()
