"""Measurements a benchmark runs as a `python -m ...` subprocess whose stdout is one JSON object: the
in-process baselines (engine, torch), run before the stack starts so that they have the cores to
themselves, and the store's transfer benchmark (client/ imports neither torch nor the store). A baseline
process can also stay up beside an idle stack and measure a round on demand (`BaselineProcess`), so that a
benchmark takes its own requests and the baseline's in turn."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
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
    from kvserve.bench import prefill  # loads torch here too, only to name the module the subprocess runs

    spec = ",".join(f"{cached}:{new}" for cached, new in turns)
    args = ["baselines", "--model", str(model), "--turns", spec, "--repeats", str(repeats), "--untimed", str(untimed),
            "--device", device, "--dtype", dtype]
    return run_module(prefill.__name__, [*args, *([] if full else ["--no-full"])])


class BaselineProcess:
    """`python -m bench.prefill baselines --serve` over (cached, new) ``turns``: loaded and warmed up (``untimed``
    rounds) on entry, then each `round()` measures one round of every turn, while the caller's stack is idle."""

    def __init__(self, model: Path, turns: Sequence[tuple[int, int]], *, full: bool = False, untimed: int = 1,
                 device: str = "cpu", dtype: str = "auto") -> None:
        from kvserve.bench import prefill

        spec = ",".join(f"{cached}:{new}" for cached, new in turns)
        self.args = [sys.executable, "-m", prefill.__name__, "baselines", "--serve", "--model", str(model),
                     "--turns", spec, "--untimed", str(untimed), "--device", device, "--dtype", dtype,
                     *([] if full else ["--no-full"])]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> BaselineProcess:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self._answer()  # {"ready": true}
        except BaseException:  # it failed to start, or Ctrl-C: it must not stay behind with the model loaded
            self.__exit__(None, None, None)
            raise
        return self

    def round(self) -> dict[str, Any]:
        """`{"torch_threads": n, "turns": [{"reuse_s": ..., "decode_step_s": ...[, "full_s": ...]}, ...]}`."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline process ({' '.join(self.args[2:5])}) exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.proc is not None
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # its loop ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
