"""Measurements a benchmark runs as a `python -m ...` subprocess whose stdout is one JSON object: the
in-process baselines (engine, torch), run before the stack starts so that they have the cores to
themselves, and the store's transfer benchmark (client/ imports neither torch nor the store)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_module(module: str, args: Sequence[str], stdin: str | None = None) -> dict[str, Any]:
    """`python -m module args...`, whose stdout is one JSON object."""
    done = subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"python -m {module} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout))


def ttft_baselines(model: Path, turns: Sequence[tuple[int, int]], repeats: int, *, full: bool = True,
                   untimed: int = 0, device: str = "cpu", dtype: str = "auto") -> dict[str, Any]:
    """`python -m bench.prefill baselines`: for each (cached, new) turn, the time to first token of
    Hugging Face over the whole prompt (`full_s`, when `full`), of the same model in one process over a
    DynamicCache of the `cached` tokens (`reuse_s`), and of the decode step after it (`decode_step_s`),
    `repeats` times each after `untimed` rounds; their medians as `full_median_s` and so on. The model runs on
    `device` in `dtype` (the services' --device and --dtype)."""
    from bench import prefill  # loads torch here too, only to name the module the subprocess runs

    spec = ",".join(f"{cached}:{new}" for cached, new in turns)
    args = ["baselines", "--model", str(model), "--turns", spec, "--repeats", str(repeats), "--untimed", str(untimed),
            "--device", device, "--dtype", dtype]
    return run_module(prefill.__name__, [*args, *([] if full else ["--no-full"])])
