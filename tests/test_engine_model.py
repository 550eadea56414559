import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma2Config, MambaConfig, MistralConfig, Qwen2Config

from kvserve.engine.model import UnsupportedModelError, encode_prompt, load_model, model_fingerprint
from tests.engine_fixtures import tiny_model, tiny_model_path


def test_loaded_model_describes_its_kv() -> None:
    model = tiny_model("llama")
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 1, 32)
    assert model.dtype == torch.float32 and model.kv_dtype_name == "float32"
    assert model.device == torch.device("cpu") and not model.hf_model.training
    assert model.eos_token_ids == {model.tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert model.fingerprint == model_fingerprint(model.path)


@pytest.mark.slow
def test_fingerprint_stable_across_processes_and_copies(tmp_path: Path) -> None:
    path = tiny_model_path("qwen2")
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from kvserve.engine.model import model_fingerprint as f; print(f(sys.argv[1]))", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    copy = shutil.copytree(path, tmp_path / "elsewhere" / "copy")
    assert child.stdout.strip() == model_fingerprint(path) == model_fingerprint(copy)


def test_fingerprint_ignores_volatile_config_keys_but_not_weights_or_config(tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_model_path("gpt2"), tmp_path / "m")
    before = model_fingerprint(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0", "_name_or_path": "/x"}))
    assert model_fingerprint(copy) == before
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-3}))
    assert model_fingerprint(copy) != before
    assert model_fingerprint(tiny_model_path("gpt2", seed=1)) != before


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (MistralConfig(sliding_window=32, num_hidden_layers=1), "sliding window"),
        (Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=0, num_hidden_layers=2), "sliding"),
        (MambaConfig(num_hidden_layers=1), "state-space"),
        (Gemma2Config(num_hidden_layers=2), "hybrid"),
    ],
)
def test_refuses_non_full_attention(tmp_path: Path, config: object, reason: str) -> None:
    config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedModelError, match=reason):
        load_model(tmp_path)


def test_encode_prompt() -> None:
    model = tiny_model("llama")
    bos = model.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert encode_prompt(model, text="ab") == [bos, 97, 98]
    chat = encode_prompt(model, messages=[{"role": "user", "content": "ab"}])
    assert chat[0] == bos and model.tokenizer.decode(chat).endswith("assistant<|end_header_id|>\n\n")
    assert encode_prompt(model, token_ids=[1, 2]) == [1, 2]
    bad_calls: list[dict[str, Any]] = [{}, {"text": "a", "token_ids": [1]}, {"token_ids": []}, {"token_ids": [10**6]}]
    for bad in bad_calls:
        with pytest.raises(ValueError):
            encode_prompt(model, **bad)


class NoTokenizing:
    """A tokenizer that must not be called."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompt was tokenized")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompt was rendered")

    chat_template = "unused"


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(kind: str) -> None:
    from dataclasses import replace

    from kvserve.engine.model import ContextLengthError

    model = tiny_model("llama")
    assert model.max_positions is not None
    huge = "a" * (model.max_positions * model.max_token_bytes)  # at least max_positions tokens, whatever they are
    prompt: dict[str, Any] = {"text": huge} if kind == "text" else {"messages": [{"role": "user", "content": huge}]}
    with pytest.raises(ContextLengthError, match="send a shorter prompt"):
        encode_prompt(replace(model, tokenizer=NoTokenizing()), **prompt)
    assert len(encode_prompt(model, text="a" * 100)) >= 1  # a prompt that may fit is tokenized as before
