"""Loading a local Hugging Face causal LM, its fingerprint, and refusal of non-full-attention caches."""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from kvserve.engine.model_check import UnsupportedModelError, check_model_folder

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# config.json keys that vary with the tool or folder that wrote the model, not with the model.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "name_or_path"})
_STATE_CONFIG_HINTS = ("ssm_", "mamba", "conv_kernel", "linear_attn", "time_step")
# Forward keywords for the cache object, preferred first: transformers 5.17 takes `past_key_values`
# and ignores `cache`; 5.24 takes `cache` (and `past_key_values`, deprecated).
CACHE_KEYWORDS = ("cache", "past_key_values")


DEFAULT_MAX_NEW_TOKENS = 256
# --dtype of the services and benchmarks; "auto" is the dtype the model's config names (model_dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ContextLengthError(ValueError):
    """A request that does not fit the model's positions (prompt + tokens to generate)."""

    grpc_status = "OUT_OF_RANGE"  # read by the servers' error interceptor


@dataclass(frozen=True, slots=True)
class Model:
    """A loaded model with the facts about its KV cache that blocks depend on."""

    hf_model: Any
    tokenizer: Any
    path: Path
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: frozenset[int]
    cache_keyword: str  # the forward keyword that fills a cache object, one of CACHE_KEYWORDS
    max_token_bytes: int = 64  # no token's text is longer in UTF-8 (a bound, for refusing long prompts early)
    max_model_len: int | None = None  # --max-model-len: fewer positions than the config's

    @property
    def kv_dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        """Most positions (prompt + generated tokens) a request may take: --max-model-len, else what the model's
        config says, if it does."""
        value = getattr(self.hf_model.config, "max_position_embeddings", None)
        return self.max_model_len or (int(value) if value else None)


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_fingerprint(path: str | Path) -> str:
    """Hex sha256 over the canonical config.json and the sha256 of each weight file, by name.

    Independent of the folder's location, of the process and of the machine.
    """
    root = Path(path)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    canonical = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {root}")
    doc = {
        "config": canonical,
        "weights": [[p.name, _sha256_file(p)] for p in weights],
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def check_full_attention(config: PretrainedConfig) -> None:
    """Raise UnsupportedModelError unless every layer keeps a plain, unbounded KV cache (the model types
    refused by name are check_model_folder's)."""
    text = config.get_text_config(decoder=True)
    hints = sorted(k for k in text.to_dict() if k.startswith(_STATE_CONFIG_HINTS))
    if hints:
        raise UnsupportedModelError(f"hybrid/state-space config (keys {hints}) has recurrent state, not plain KV")
    window = getattr(text, "sliding_window", None)
    if window is not None and getattr(text, "use_sliding_window", True):
        raise UnsupportedModelError(f"sliding window attention is in use (sliding_window={window})")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError("chunked (local) attention is in use")
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        reason = "sliding window attention" if any("sliding" in t for t in odd) else "hybrid layers"
        raise UnsupportedModelError(f"{reason} in use (layer_types include {odd})")
    try:
        layers = DynamicCache(config=config).layers
    except Exception as e:  # a config the cache machinery cannot describe is not plain KV either
        raise UnsupportedModelError(f"cannot build a KV cache for this config: {e}") from e
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if kinds:
        raise UnsupportedModelError(f"cache layers {kinds} are not plain full-attention KV")


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [batch, kv_heads, seq, head_dim] of one plain full-attention cache layer."""
    if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
        raise UnsupportedModelError(f"cache layer {type(layer).__name__} is not plain full-attention KV")
    return layer.keys, layer.values


@dataclass(frozen=True, slots=True)
class CacheProbe:
    """What one probe forward showed about a model's cache."""

    keyword: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def probe_cache(hf_model: Any, device: torch.device) -> CacheProbe:
    """Run one token through the model and read the cache keyword and KV shape off the filled cache.

    Each keyword of CACHE_KEYWORDS is tried (those the forward declares first) until a forward
    fills the cache: a forward taking ``**kwargs`` silently ignores a name it does not know.
    Raises UnsupportedModelError, naming the transformers version, when none fills it.
    """
    declared = inspect.signature(hf_model.forward).parameters
    input_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    failures: list[str] = []
    for keyword in sorted(CACHE_KEYWORDS, key=lambda k: k not in declared):
        cache = DynamicCache(config=hf_model.config)
        try:
            with torch.inference_mode():
                hf_model(input_ids=input_ids, use_cache=True, **{keyword: cache})
        except TypeError as e:
            failures.append(f"{keyword}=: {e}")
            continue
        if cache.get_seq_length() > 0:
            return CacheProbe(keyword, *_kv_shape(cache))
        failures.append(f"{keyword}=: the forward ran but left the cache empty")
    raise UnsupportedModelError(
        f"transformers {transformers.__version__}: no forward keyword fills a KV cache ({'; '.join(failures)})"
    )


def _kv_shape(cache: DynamicCache) -> tuple[int, int, int, torch.dtype]:
    """(layers, kv_heads, head_dim, dtype) of a filled cache, which must be alike in every layer."""
    kvs = [layer_kv(layer) for layer in cache.layers]
    shapes = {(tuple(k.shape), tuple(v.shape)) for k, v in kvs}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"layers keep KV of different shapes {sorted(shapes)}")
    (key_shape, value_shape), = shapes
    if key_shape != value_shape:
        raise UnsupportedModelError(f"keys {key_shape} and values {value_shape} differ in shape")
    _, num_kv_heads, _, head_dim = key_shape  # [batch, kv_heads, seq, head_dim]
    return len(kvs), num_kv_heads, head_dim, kvs[0][0].dtype


def _eos_ids(hf_model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(hf_model, "generation_config", None)
    for value in (hf_model.config.eos_token_id, getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs it asynchronously): before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_dtype(config: PretrainedConfig, name: str = "auto") -> torch.dtype:
    """The dtype a --dtype ``name`` loads the model in: "auto" is the one its config names, float32 when it
    names none."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: choose auto or one of {', '.join(DTYPES)}")
        return DTYPES[name]
    value = getattr(config, "dtype", None)  # transformers reads a config's older torch_dtype into it too
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
               max_model_len: int | None = None) -> Model:
    """Load a local HF causal-LM folder (never downloads), in eval mode, on ``device``, in ``dtype``: a
    torch dtype, or a --dtype name (None: "auto", see model_dtype). ValueError for an unknown name, and for a
    ``max_model_len`` past the model's positions.

    Raises FileNotFoundError without a config.json, UnsupportedModelError before loading weights when the
    model is not a causal LM the engine serves (check_model_folder) or its cache is not plain full attention,
    and after when no forward keyword of the installed transformers fills a cache (see probe_cache).
    """
    root = Path(path).resolve()
    check_model_folder(root)
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    check_full_attention(config)
    positions = getattr(config, "max_position_embeddings", None)
    if max_model_len is not None and positions and max_model_len > positions:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's {positions} positions")
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available to this torch ({torch.__version__})")
    if not isinstance(dtype, torch.dtype):
        dtype = model_dtype(config, dtype or "auto")
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" would fill every service's log
    try:
        hf_model: Any = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    hf_model.to(torch_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    probe = probe_cache(hf_model, torch_device)
    return Model(
        hf_model=hf_model,
        tokenizer=tokenizer,
        path=root,
        fingerprint=model_fingerprint(root),
        device=torch_device,
        dtype=probe.dtype,
        num_layers=probe.num_layers,
        num_kv_heads=probe.num_kv_heads,
        head_dim=probe.head_dim,
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        cache_keyword=probe.keyword,
        max_token_bytes=4 * max(len(token) for token in tokenizer.get_vocab()),  # 4: UTF-8 bytes per character
        max_model_len=max_model_len,
    )


def encode_prompt(
    model: Model,
    *,
    text: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
) -> list[int]:
    """Token ids for exactly one of: raw text, chat messages (rendered with the chat template and a
    generation prompt), or token ids (validated against the vocabulary). Raises ValueError."""
    if sum(x is not None for x in (text, messages, token_ids)) != 1:
        raise ValueError("give exactly one of text, messages or token_ids")
    _refuse_before_tokenizing(model, text if text is not None else "".join(m["content"] for m in messages or ()))
    tokenizer = model.tokenizer
    if text is not None:
        ids = list(tokenizer(text)["input_ids"])
    elif messages is not None:
        if tokenizer.chat_template is None:
            raise ValueError(f"model at {model.path} has no chat template")
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    else:
        assert token_ids is not None
        ids = [int(t) for t in token_ids]
        vocab = model.vocab_size  # a property that walks the model: once, not per token
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def _refuse_before_tokenizing(model: Model, text: str) -> None:
    """ContextLengthError for a text too long to fit the model whatever it tokenizes to (every token
    covers at most `max_token_bytes` of it): a prompt of megabytes is refused at once, not after
    seconds of tokenizing."""
    limit = model.max_positions
    if limit is None or len(text) * 4 < limit * model.max_token_bytes:  # 4: UTF-8 bytes per character at most
        return
    num_bytes = len(text.encode())
    at_least = -(-num_bytes // model.max_token_bytes)
    if at_least >= limit:
        raise ContextLengthError(
            f"the prompt is {num_bytes} bytes, at least {at_least} tokens; the model takes at most {limit} "
            "positions: send a shorter prompt"
        )


def max_new_tokens(model: Model, num_prompt_tokens: int, requested: int) -> int:
    """How many tokens a request may generate: ``requested``, or when 0 the default capped by the
    room left. Raises ContextLengthError when the prompt, or prompt + ``requested``, exceeds the
    model's positions."""
    limit = model.max_positions
    if limit is None:
        return requested or DEFAULT_MAX_NEW_TOKENS
    if num_prompt_tokens >= limit:
        raise ContextLengthError(
            f"the prompt has {num_prompt_tokens} tokens; the model takes at most {limit} positions, "
            f"so the prompt must be shorter than {limit} tokens"
        )
    room = limit - num_prompt_tokens
    if requested == 0:
        return min(DEFAULT_MAX_NEW_TOKENS, room)
    if requested > room:
        raise ContextLengthError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({requested}) = {num_prompt_tokens + requested} "
            f"exceeds the model's {limit} positions: ask for at most {room} tokens"
        )
    return requested
