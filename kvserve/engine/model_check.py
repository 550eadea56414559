"""Which model folders the engine serves, judged from config.json alone, before any weight is read.

Stdlib only: `kvserve up` checks its model with it before it starts a service, and engine.model.load_model
checks with it first. The engine runs a model's own Hugging Face code with its paged cache in place of
Hugging Face's, so it serves the causal-LM types it has been checked on against Hugging Face `generate`;
others load but fail at the first request (OPT, Bloom, Falcon and BERT ask the cache for its length).
"""

from __future__ import annotations

import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi", "gpt_neox")
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # GPT-2's head is GPT2LMHeadModel
STATE_SPACE_MODEL_TYPES = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "retnet"}
)
HYBRID_MODEL_TYPES = frozenset(
    {
        "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2",
        "lfm2_moe", "qwen3_next", "minimax", "plamo2", "gemma2", "gemma3", "gemma3_text", "gemma3n",
        "gemma3n_text", "gemma4", "cohere2", "gpt_oss",
    }
)  # fmt: skip
SUPPORTED = f"kvserve serves causal LMs of model type {', '.join(SUPPORTED_MODEL_TYPES)} with full attention"


class UnsupportedModelError(ValueError):
    """A model the engine does not serve (not a causal LM, a type it cannot page, a cache that is not plain
    per-layer full-attention KV); the message names why."""


def check_model_folder(path: str | Path) -> None:
    """Raise FileNotFoundError when ``path`` holds no config.json, UnsupportedModelError (one line: what the
    model is, what is served) when its ``architectures`` name no causal LM or its ``model_type`` is not one
    of SUPPORTED_MODEL_TYPES."""
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        what = "does not exist" if not root.exists() else "has no config.json"
        raise FileNotFoundError(
            f"no model at {root}: the folder {what}; expected a local Hugging Face model folder with config.json "
            "(`kvserve model init DIR` builds a tiny one)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, not UTF-8
        raise UnsupportedModelError(f"{config_path} is not a JSON config: {e}") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{config_path} holds no JSON object")
    reason = _refusal(str(config.get("model_type") or ""), [str(a) for a in config.get("architectures") or ()])
    if reason:
        raise UnsupportedModelError(f"{reason}; {SUPPORTED}")


def _refusal(model_type: str, architectures: list[str]) -> str | None:
    if not model_type:
        return "its config.json names no model_type"
    what = f"{'/'.join(architectures)} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    if architectures and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in architectures):
        return f"{what} is not a causal LM"
    if model_type in STATE_SPACE_MODEL_TYPES:
        return f"{what} is a state-space model, with no per-token KV cache"
    if model_type in HYBRID_MODEL_TYPES:
        return f"{what} is a hybrid model, mixing full attention with sliding-window or recurrent layers"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"{what} is a causal LM the engine cannot page"
    return None
