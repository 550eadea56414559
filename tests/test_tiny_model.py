import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvserve.engine import tiny
from kvserve.engine.model import load_model
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


def test_bfloat16_is_the_float32_model_rounded_and_loads_as_bfloat16(tmp_path: Path) -> None:
    small = ["--layers", "1", "--hidden", "64"]
    assert tiny.main([str(tmp_path / "f32"), *small]) == 0
    assert tiny.main([str(tmp_path / "bf16"), *small, "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    f32, bf16 = load_file(tmp_path / "f32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert f32.keys() == bf16.keys()
    for name, weight in f32.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], weight.to(torch.bfloat16))
    model = load_model(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.hf_model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_shape_flags_are_honoured(tmp_path: Path, arch: str) -> None:
    kv_heads = "4" if arch == "gpt2" else "2"
    args = ["--arch", arch, "--layers", "1", "--hidden", "128", "--heads", "4", "--kv-heads", kv_heads,
            "--intermediate", "96", "--max-positions", "16640"]  # fmt: skip
    assert tiny.main([str(tmp_path / "m"), *args]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert config.max_position_embeddings == 16640  # gpt2 maps it to n_positions
    tokenizer_config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 16640
    model = load_model(tmp_path / "m")
    assert (model.num_kv_heads, model.head_dim) == (int(kv_heads), 32)
    assert model.hf_model.get_output_embeddings().weight.shape[1] == 128


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-positions", "0"], "--max-positions: must be > 0, got 0"),
        (["--max-positions", "-16640"], "--max-positions: must be > 0, got -16640"),
        (["--layers", "0"], "--layers: must be > 0, got 0"),
        (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
        (["--hidden", "64", "--heads", "3"], "hidden size 64 must split into 3 heads of even size"),
        (["--hidden", "64", "--kv-heads", "3"], "2 heads must split into 3 kv heads evenly"),
        (["--arch", "gpt2", "--kv-heads", "1"], "gpt2 has no grouped-query attention"),
    ],
)
def test_cli_refuses_bad_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tiny.main([str(tmp_path / "m"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_bench_model_args_give_half_to_one_billion_parameters() -> None:
    args = tiny.build_parser().parse_args(["unused", *tiny.BENCH_MODEL_ARGS.split()])
    config = tiny.model_config(
        args.arch, 261, {"bos": 256, "eos": 257}, args.layers, args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, max_positions=args.max_positions,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 0.5e9 < sum(p.numel() for p in model.parameters()) < 1e9
    assert args.max_positions >= 16 * 1024 + 256 and args.dtype == "bfloat16"
