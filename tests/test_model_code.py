"""The engine's two forwards against Hugging Face ``generate``, on the seven architectures it serves: its own code
for the llama family (engine.llama: Llama, Mistral, Qwen2, Qwen3) and Hugging Face's modules (every model, and the
llama family with KVSERVE_MODEL_CODE=hf), in each cache state a step meets: cold, the whole prompt or a part of it
in the pool, loaded from a store, and batched with other sequences in chunked prefill."""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvserve.engine.llama import LlamaForward
from kvserve.engine.model import load_model
from kvserve.engine.model_check import SUPPORTED_MODEL_TYPES
from tests.engine_fixtures import (
    DictStore,
    PrefixSource,
    _workdir,
    assert_matches_oracle,
    make_engine,
    make_seq,
    random_tokens,
    run,
    tiny_model_path,
)

BLOCK = 8
NEW = 10
OWN_CODE = ("llama", "mistral", "qwen2", "qwen3")


def _config(arch: str, vocab: int) -> PretrainedConfig:
    """Two layers of hidden 64, grouped-query attention where the architecture has it; weights of unit-ish logits
    (engine.tiny's spread), so that greedy steps are rarely near ties."""
    common = {"vocab_size": vocab, "initializer_range": 0.125, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False}
    llama_like = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 128, "max_position_embeddings": 256, **common}
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **llama_like)
    if arch == "phi":
        return PhiConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=256, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             max_position_embeddings=256, **common)
    assert arch == "gpt2"
    return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_inner=128, n_positions=256, **common)


@cache
def model_path(arch: str) -> Path:
    """A seeded random model of ``arch`` beside the tiny llama's tokenizer, written once per test process."""
    tokenizer_from = tiny_model_path("llama")
    out = _workdir() / f"arch-{arch}"
    vocab = AutoModelForCausalLM.from_pretrained(tokenizer_from).config.vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(_config(arch, vocab), dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def test_the_seven_architectures_are_those_the_engine_serves() -> None:
    assert sorted(SUPPORTED_MODEL_TYPES) == sorted(("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi", "gpt_neox"))


@pytest.mark.parametrize(("arch", "code"), [*((a, "own") for a in OWN_CODE), *((a, "hf") for a in SUPPORTED_MODEL_TYPES),
                                           ("llama", "own-onednn"), ("qwen2", "own-onednn")])
def test_both_forwards_equal_hf_generate_in_every_cache_state(arch: str, code: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``own-onednn``: the own forward with its products through oneDNN (KVSERVE_NATIVE_LINEAR=0), not the
    C kernel's."""
    if code == "hf":
        monkeypatch.setenv("KVSERVE_MODEL_CODE", "hf")
    if code == "own-onednn":
        monkeypatch.setenv("KVSERVE_NATIVE_LINEAR", "0")
    model = load_model(model_path(arch))
    engine = make_engine(model, BLOCK, 64, max_num_batched_tokens=16, max_num_seqs=4)  # prompts in chunks
    assert isinstance(engine.runner.forward, LlamaForward) == code.startswith("own")
    root = engine.namespace().root()
    prompt = random_tokens(5 * BLOCK + 3, seed=11)

    cold = make_seq(model, prompt, NEW, hash_root=root)
    warm = make_seq(model, prompt, NEW, hash_root=root)  # every full block from the pool
    partial = make_seq(model, [*prompt[: 3 * BLOCK], *random_tokens(9, seed=12)], NEW, hash_root=root)
    for seq in (cold, warm, partial):
        (outcome,) = run(engine, [seq])
        assert_matches_oracle(model, seq, outcome)
    assert warm.stats.num_pool_hit_tokens == 5 * BLOCK and partial.stats.num_pool_hit_tokens == 3 * BLOCK

    together = [make_seq(model, random_tokens(n, seed=20 + n), NEW, hash_root=root) for n in (3, 2 * BLOCK + 5, 29)]
    for seq, outcome in zip(together, run(engine, together), strict=True):  # decode rows beside prompt chunks
        assert_matches_oracle(model, seq, outcome)

    source = PrefixSource(DictStore(), engine.namespace())  # private blocks: saved there, loaded back
    saved, loaded = (make_seq(model, prompt, NEW, source=source) for _ in range(2))
    run(engine, [saved])
    (outcome,) = run(engine, [loaded])
    assert loaded.stats.num_loaded_tokens == 5 * BLOCK
    assert_matches_oracle(model, loaded, outcome)


def test_a_rope_that_depends_on_the_length_runs_through_hugging_faces_modules(tmp_path: Path) -> None:
    """Dynamic NTK scaling changes cos and sin with the sequence's length: no table holds them."""
    path = model_path("llama")
    model = load_model(path)
    assert LlamaForward.of(model.hf_model) is not None
    shutil.copytree(path, tmp_path / "dynamic")
    config = AutoModelForCausalLM.from_pretrained(path).config
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    config.save_pretrained(tmp_path / "dynamic")
    assert LlamaForward.of(load_model(tmp_path / "dynamic").hf_model) is None
