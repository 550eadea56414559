"""Seeded random-weight models in Hugging Face format, with a byte-level tokenizer, fully offline.

``kvserve model init DIR --arch llama|qwen2|gpt2 [--seed N]``: the same arguments give the same bytes.
Weights are drawn in float32 and then cast, so a ``--dtype bfloat16`` model is the float32 one rounded.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from kvserve.engine.model import DTYPES

ARCHS = ("llama", "qwen2", "gpt2")
DEFAULT_LAYERS = 8
DEFAULT_HIDDEN = 512
MAX_POSITIONS = 4096
BENCH_MODEL_ARGS = (
    "--layers 24 --hidden 1536 --heads 12 --kv-heads 4 --intermediate 4096 --dtype bfloat16 --max-positions 16896"
)  # a ~0.6B llama: 24 x 25.2M per layer, with the byte vocabulary's 0.8M in the embeddings

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    stop: tuple[str, ...]  # tokens that end generation
    chat_template: str


TOKENIZERS = {
    "llama": TokenizerSpec(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        stop=("<|end_of_text|>", "<|eot_id|>"),
        chat_template=LLAMA_TEMPLATE,
    ),
    "qwen2": TokenizerSpec(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        stop=("<|im_end|>", "<|endoftext|>"),
        chat_template=CHATML_TEMPLATE,
    ),
    "gpt2": TokenizerSpec(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        stop=("<|endoftext|>", "<|im_end|>"),
        chat_template=CHATML_TEMPLATE,
    ),
}


def _byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Byte-level BPE without merges: each of the 256 bytes is one token, then the special tokens."""
    vocab = {ch: byte for byte, ch in enumerate(_byte_level_chars())}  # token id == byte value
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(spec.specials))
    return tokenizer


def attention_sizes(
    arch: str, hidden: int, heads: int | None, kv_heads: int | None, intermediate: int | None
) -> tuple[int, int, int]:
    """(heads, kv_heads, intermediate), each None following ``hidden``; ValueError on a shape ``arch`` cannot take."""
    heads = max(2, hidden // 64) if heads is None else heads
    kv_heads = (heads if arch == "gpt2" else max(1, heads // 2)) if kv_heads is None else kv_heads
    intermediate = 4 * hidden if intermediate is None else intermediate
    if min(hidden, heads, kv_heads, intermediate) <= 0:
        raise ValueError("hidden, heads, kv heads and intermediate sizes must be > 0")
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden size {hidden} must split into {heads} heads of even size")
    if heads % kv_heads:
        raise ValueError(f"{heads} heads must split into {kv_heads} kv heads evenly")
    if arch == "gpt2" and kv_heads != heads:
        raise ValueError("gpt2 has no grouped-query attention: kv heads must equal heads")
    return heads, kv_heads, intermediate


def model_config(
    arch: str,
    vocab_size: int,
    ids: dict[str, int | None],
    layers: int,
    hidden: int,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = MAX_POSITIONS,
) -> PretrainedConfig:
    heads, kv_heads, intermediate = attention_sizes(arch, hidden, heads, kv_heads, intermediate)
    if layers <= 0 or max_positions <= 0:
        raise ValueError(f"layers and max positions must be > 0, got {layers} and {max_positions}")
    std = max(0.02, hidden**-0.5)  # logits of unit-ish spread, so greedy steps are rarely near-ties
    bos, eos = ids["bos"], ids["eos"]
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_layer=layers, n_embd=hidden, n_head=heads, n_inner=intermediate,
            n_positions=max_positions, initializer_range=std, bos_token_id=bos, eos_token_id=eos,
        )  # fmt: skip
    config_cls = LlamaConfig if arch == "llama" else Qwen2Config
    return config_cls(
        vocab_size=vocab_size, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate,
        max_position_embeddings=max_positions, initializer_range=std, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=bos, eos_token_id=eos,
    )  # fmt: skip


def _write_tokenizer(out: Path, spec: TokenizerSpec, tokenizer: Tokenizer, max_positions: int) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.eos,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": spec.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    # A bos token only for llama: prepend it to plain-text prompts the way Llama tokenizers do.
    if spec.bos is not None and spec.bos != spec.eos:
        data = json.loads((out / "tokenizer.json").read_text())
        bos_id = tokenizer.token_to_id(spec.bos)
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": spec.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": spec.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {spec.bos: {"id": spec.bos, "ids": [bos_id], "tokens": [spec.bos]}},
        }  # fmt: skip
        (out / "tokenizer.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def init_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    layers: int = DEFAULT_LAYERS,
    hidden: int = DEFAULT_HIDDEN,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = MAX_POSITIONS,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a seeded random-weight causal LM (safetensors), tokenizer and chat template to ``out_dir``.

    Sizes left None follow ``hidden`` (see attention_sizes); the weights are saved in ``dtype``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    spec = TOKENIZERS[arch]
    tokenizer = build_tokenizer(spec)
    ids = {
        "bos": tokenizer.token_to_id(spec.bos) if spec.bos else None,
        "eos": tokenizer.token_to_id(spec.eos),
    }
    config = model_config(
        arch, tokenizer.get_vocab_size(), ids, layers, hidden,
        heads=heads, kv_heads=kv_heads, intermediate=intermediate, max_positions=max_positions,
    )  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"],
        eos_token_id=[tokenizer.token_to_id(t) for t in spec.stop],
        pad_token_id=ids["eos"],
    )
    model.save_pretrained(out)
    _write_tokenizer(out, spec, tokenizer, max_positions)
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve model init", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"a ~0.6B model for a GPU benchmark (about 25 s and 1.2 GB on 2 CPU cores):\n"
               f"  kvserve model init data/models/llama-0.6b {BENCH_MODEL_ARGS}",
    )  # fmt: skip
    parser.add_argument("dir", type=Path, help="folder to write the model into")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=_positive_int, default=DEFAULT_LAYERS)
    parser.add_argument("--hidden", type=_positive_int, default=DEFAULT_HIDDEN, help="hidden size")
    parser.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default hidden/64)")
    parser.add_argument("--kv-heads", type=_positive_int, default=None,
                        help="key/value heads (default heads/2; gpt2: heads)")
    parser.add_argument("--intermediate", type=_positive_int, default=None, help="MLP size (default 4 * hidden)")
    parser.add_argument("--max-positions", type=_positive_int, default=MAX_POSITIONS,
                        help="longest sequence the model takes (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the saved weights (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing model folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        attention_sizes(args.arch, args.hidden, args.heads, args.kv_heads, args.intermediate)
    except ValueError as e:
        parser.error(str(e))
    hf_logging.disable_progress_bar()
    if (args.dir / "config.json").exists():
        if not args.force:
            print(f"{args.dir} already holds a model; pass --force to overwrite", file=sys.stderr)
            return 1
        shutil.rmtree(args.dir)
    path = init_tiny_model(
        args.dir, args.arch, args.seed, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, max_positions=args.max_positions,
        dtype=DTYPES[args.dtype],
    )  # fmt: skip
    with safe_open(path / "model.safetensors", "pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    print(f"wrote {args.arch} model ({params / 1e6:.1f}M parameters, {args.dtype}, seed {args.seed}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
