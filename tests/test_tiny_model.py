import filecmp
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine import tiny
from engine.model import load_model
from tests.engine_fixtures import ARCHS, NEAR_TIE_GAP, random_tokens, tiny_model, tiny_model_path, top2_gap

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = tiny.init_tiny_model(tmp_path / "a", "llama", seed=0, layers=2, hidden=64)
    b = tiny.init_tiny_model(tmp_path / "b", "llama", seed=0, layers=2, hidden=64)
    c = tiny.init_tiny_model(tmp_path / "c", "llama", seed=1, layers=2, hidden=64)
    assert sorted(p.name for p in a.iterdir()) == FILES
    match, mismatch, errors = filecmp.cmpfiles(a, b, FILES, shallow=False)
    assert match == FILES and not mismatch and not errors
    assert not filecmp.cmp(a / "model.safetensors", c / "model.safetensors", shallow=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_byte_level_tokenizer_and_chat_template(arch: str) -> None:
    path = tiny_model_path(arch)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "héllo, wörld \x00\xff ☃"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tok.decode(ids) == text
    assert tok.chat_template == json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in rendered and "assistant" in rendered


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_not_degenerate(arch: str) -> None:
    model = tiny_model(arch)
    with torch.inference_mode():
        logits = model.hf_model(torch.tensor([random_tokens(64, seed=3)])).logits[0]  # [64, vocab]
    assert len(set(logits.argmax(-1).tolist())) > 16
    gaps = torch.tensor([top2_gap(row) for row in logits])
    assert (gaps > NEAR_TIE_GAP).float().mean() > 0.9


def test_cli_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    args = [str(tmp_path / "m"), "--arch", "gpt2", "--layers", "1", "--hidden", "64"]
    assert tiny.main(args) == 0
    assert tiny.main(args) == 1
    assert tiny.main([*args, "--force", "--seed", "5"]) == 0


def test_default_llama_is_about_30m_parameters(tmp_path: Path) -> None:
    model = load_model(tiny.init_tiny_model(tmp_path / "default"))
    params = sum(p.numel() for p in model.hf_model.parameters())
    assert 25e6 < params < 40e6
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (8, 4, 64)
