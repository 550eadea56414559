"""Linear layers whose weights oneDNN has reordered once, at start, into its blocked layout for this CPU.

torch's ``nn.Linear`` on a CPU calls MKL's GEMM with the weight as stored, and a decode step's few rows
against a weight matrix are bound by how fast that matrix streams in: measured here (one core, the tiny
model's 24 weight matrices of 2048 x 512), 11.0 ms for 4 rows as stored, 3.6 ms prepacked; 43.6 against
16.7 ms for 64 rows, 157 against 56 ms for 256. vLLM's CPU build runs its linear layers the same way. The
results differ from MKL's in the last bits (a different order of the same fp32 sums), as any other kernel's
would: greedy tokens match Hugging Face's but where its top two logits all but tie.

The engine packs the model it runs (engine.model_runner); a Hugging Face forward of the same model object
then runs through these layers too, so an oracle must load the model on its own.
"""

from __future__ import annotations

from typing import Any

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's linear kernels for ``device`` and ``dtype`` on this CPU (fp32, or bf16
    where the CPU has its instructions)."""
    if not (device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # bf16 needs AVX-512 (or AVX-NE-CONVERT): elsewhere oneDNN refuses it, and MKL's path stays
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a weight in oneDNN's layout (``weight`` is that tensor: its shape, dtype and
    device are the layer's, its data readable only by oneDNN)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(hf_model: Any) -> int:
    """Replace every ``nn.Linear`` of ``hf_model`` with a PackedLinear, but an output embedding that shares its
    weight with the input embedding (tied: the embedding still reads it); how many were replaced. Nothing
    where ``can_pack`` says no."""
    params = next(hf_model.parameters(), None) if isinstance(hf_model, torch.nn.Module) else None
    if params is None or not can_pack(params.device, params.dtype):  # not a model (a test's stand-in)
        return 0
    out, inp = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    tied = (type(out) is torch.nn.Linear and inp is not None
            and out.weight.data_ptr() == inp.weight.data_ptr())  # (a second engine on the model finds it packed)
    replaced = 0
    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and not (tied and child is out) and child.weight.dtype in PACKED_DTYPES:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
