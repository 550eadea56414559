"""The engine's C kernels built ahead of time (`kvserve build-kernels`, engine.native) for portable targets, the
best one a CPU runs loaded, the fallback said with its reason; the engines' metrics and `kvserve stats` name it."""

from __future__ import annotations

import platform
import shutil
import stat
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from client.metrics import parse_metrics
from kvserve.cli.commands import attention_lines, forwarded
from kvserve.engine import native
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.native import SDPA, TARGETS, AttentionKernel
from tests.engine_fixtures import make_engine, tiny_model

TARGETS_HERE = TARGETS.get(platform.machine(), ())
needs_cc = pytest.mark.skipif(shutil.which("cc") is None or not TARGETS_HERE,
                              reason="no C compiler, or no portable target for this machine")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the command built the kernels into, over an older build of the least target."""
    folder = tmp_path_factory.mktemp("kernels")
    stale = folder / f"native-{TARGETS_HERE[-1].march}-0123456789abcdef.so" if TARGETS_HERE else folder / "x"
    stale.write_bytes(b"an older source's")
    command = forwarded(["build-kernels", str(folder)])
    assert command is not None and command[0](command[1]) == 0
    assert not stale.exists()
    return folder


@needs_cc
def test_the_command_builds_a_kernel_per_target_and_the_best_this_cpu_runs_loads(built: Path) -> None:
    assert sorted(p.name for p in built.iterdir()) == sorted(native.prebuilt_name(t) for t in TARGETS_HERE)
    assert not stat.S_IMODE(built.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    cpu = native.cpu_flags()
    best = next(t for t in TARGETS_HERE if t.needs <= cpu)  # this test's CPU runs at least x86-64-v3
    lib, kernel = native.load(built, compiler=None)
    assert lib is not None and kernel == AttentionKernel(f"native-{best.march}")

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 2, 2, 16, 2, 32, generator=g)  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    q = torch.randn(1, 2, 3, 32, generator=g)  # [rows, kv_heads, group, head_dim]
    out, _ = native.decode_attention(lib)(q, kv, 1, torch.tensor([[4, 1]]), torch.tensor([20]), 0.5)
    keys = kv[[4, 1], 1, 0].reshape(-1, 2, 32)[:20].transpose(0, 1)  # [kv_heads, 20, head_dim]
    values = kv[[4, 1], 1, 1].reshape(-1, 2, 32)[:20].transpose(0, 1)
    torch.testing.assert_close(out[0], torch.softmax(q[0] @ keys.transpose(1, 2) * 0.5, -1) @ values)


@needs_cc
def test_a_cpu_short_of_a_targets_flags_takes_the_next_or_the_fallback_and_says_why(built: Path) -> None:
    least = TARGETS_HERE[-1]
    assert native.load(built, None, cpu=least.needs)[1] == AttentionKernel(f"native-{least.march}")
    if least.needs:
        lacks = " ".join(sorted(least.needs))
        assert native.load(built, None, cpu=frozenset()) == (None, AttentionKernel(
            SDPA, f"this CPU lacks {lacks}, which {least.march}, the least prebuilt, needs"))


@needs_cc
def test_kernels_others_can_replace_are_not_loaded(built: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kernels"
    shutil.copytree(built, folder)
    folder.chmod(0o777)
    lib = folder / native.prebuilt_name(TARGETS_HERE[0])
    assert native.load(folder, None, cpu=TARGETS_HERE[0].needs) == (None, AttentionKernel(
        SDPA, f"{lib} or its folder can be written by others than root and this user"))


def test_no_prebuilt_kernel_and_no_compiler_is_the_fallback_with_both_reasons(tmp_path: Path) -> None:
    assert native.load(tmp_path, "no-such-cc") == (None, AttentionKernel(
        SDPA, f"none prebuilt for this source in {tmp_path} (`kvserve build-kernels` builds them); and none built "
              "here: no C compiler 'no-such-cc' on PATH"))


def test_an_engine_names_its_kernel_and_a_cache_the_kernel_cannot_read_is_the_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_engine(tiny_model("llama"), 16, 8).runner
    assert runner.attention == native.attention_kernel("cpu", torch.float32)
    assert runner.in_place_decode == (runner.attention.name != SDPA)
    assert native.attention_kernel("cuda") == AttentionKernel(SDPA, "the KV cache is on cuda: the C kernel reads "
                                                                    "host memory")
    assert native.attention_kernel("cpu", torch.bfloat16) == native.attention_kernel("cpu", torch.float32)
    assert native.attention_kernel("cpu", torch.float16) == AttentionKernel(
        SDPA, "the KV cache is float16: the C kernel reads float32 and bfloat16")
    monkeypatch.setenv("KVSERVE_NATIVE_ATTENTION", "0")
    assert native.attention_kernel() == AttentionKernel(SDPA, "turned off (KVSERVE_NATIVE_ATTENTION=0)")


def test_the_metric_names_the_kernel_and_stats_says_which_and_why() -> None:
    registry = CollectorRegistry()
    decode = EngineMetrics(registry, "kvserve_decode_")  # this process's kernel
    EngineMetrics(registry, "kvserve_prefill_", AttentionKernel("native-x86-64-v4"))
    ours = native.attention_kernel()
    get = registry.get_sample_value
    assert get("kvserve_decode_engine_attention_kernel", {"kernel": ours.name, "reason": ours.reason}) == 1
    assert get("kvserve_prefill_engine_attention_kernel", {"kernel": "native-x86-64-v4", "reason": ""}) == 1
    why = 'none prebuilt for this source in /usr/local/share/kvserve/kernels; and none built here: "cc" failed'
    decode.show_attention(AttentionKernel(SDPA, why))  # the one before is gone from the page
    assert get("kvserve_decode_engine_attention_kernel", {"kernel": ours.name, "reason": ours.reason}) is None
    samples = parse_metrics(generate_latest(registry).decode())
    assert attention_lines(samples) == [
        f"decode attention: sdpa, the slower fallback (decode rows gathered for SDPA): {why}",
        "prefill attention: native-x86-64-v4, the C kernel",
    ]
