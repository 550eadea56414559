"""A model folder the engine does not serve is refused at load, in one line naming what it is and what is
served: by engine.model_check, by load_model, by the services (exit 2) and by `kvserve up` before it
starts anything (exit 2)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertConfig, BertForMaskedLM

from kvserve.engine.model import load_model
from kvserve.engine.model_check import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_model_folder
from kvserve.engine.tiny import ARCHS
from tests.engine_fixtures import tiny_model_path
from tests.processes import KVSERVE, free_ports

BERT_REFUSED = "BertForMaskedLM (model_type 'bert') is not a causal LM; kvserve serves causal LMs of model type"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT masked LM: AutoModelForCausalLM loads it (as BertLMHeadModel), the engine cannot serve it."""
    path = tmp_path_factory.mktemp("bert")
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertForMaskedLM(config).save_pretrained(path)
    return path


def write_config(path: Path, config: dict[str, object]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_masked_lm_is_refused_in_one_line_naming_what_is_served(bert: Path) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_folder(bert)
    message = str(refused.value)
    assert message.startswith(BERT_REFUSED) and "\n" not in message, message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES), message
    with pytest.raises(UnsupportedModelError, match=re.escape(BERT_REFUSED)):
        load_model(bert)


@pytest.mark.parametrize(("config", "reason"), [
    ({"model_type": "opt", "architectures": ["OPTForCausalLM"]}, "OPTForCausalLM (model_type 'opt') is a causal LM "
                                                                  "the engine cannot page"),
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, "is not a causal LM"),
    ({"model_type": "mamba"}, "model_type 'mamba' is a state-space model"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "is a hybrid model"),
    ({"architectures": ["LlamaForCausalLM"]}, "names no model_type"),
])
def test_refuses_what_the_engine_does_not_serve(tmp_path: Path, config: dict[str, object], reason: str) -> None:
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)):
        check_model_folder(write_config(tmp_path / "m", config))


def test_a_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{")
    with pytest.raises(UnsupportedModelError, match="is not a JSON config"):
        check_model_folder(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tiny_models_pass(arch: str) -> None:
    check_model_folder(tiny_model_path(arch))


def test_a_folder_without_a_config_is_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    with pytest.raises(FileNotFoundError, match=re.escape(f"no model at {missing}: the folder does not exist")):
        check_model_folder(missing)
    with pytest.raises(FileNotFoundError, match="the folder has no config.json"):
        check_model_folder(tmp_path)


def test_up_refuses_a_masked_lm_before_starting_anything(tmp_path: Path, bert: Path) -> None:
    decode, prefill, store = free_ports(3)
    done = subprocess.run(
        [KVSERVE, "up", "--model", str(bert), "--data-dir", str(tmp_path / "data"), "--decode-port", str(decode),
         "--prefill-port", str(prefill), "--store-port", str(store), "--no-http"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"kvserve up: cannot serve {bert}: {BERT_REFUSED}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert not (tmp_path / "data" / "logs").exists()  # no service was started


def test_up_checks_the_model_without_importing_torch() -> None:
    """`up` decides on config.json alone: its process imports no torch or transformers to refuse a model."""
    probe = "import sys, kvserve.cli.commands; print(sorted({'torch', 'transformers'} & sys.modules.keys()))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow
def test_decode_service_refuses_a_masked_lm_with_exit_2(tmp_path: Path, bert: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "decode_service", "--model", str(bert), "--listen", "127.0.0.1:0",
                           "--insecure"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"decode: cannot serve {bert}: {BERT_REFUSED}" in done.stderr and "Traceback" not in done.stderr
