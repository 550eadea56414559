"""kvserve on a host doing other work: two busy loops beside a `kvserve up` on the real model, as on a developer's
laptop or a CI runner. A 32-token answer must cost about what Hugging Face's `generate` costs in the same
conditions, not many times more (the engine used to compute 10 nice levels below everything, and lost its cores
to the loops: 3-22x). Ratios of times measured in the same run, never absolute times."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.processes import free_ports, openmp_as_deployed, running_up
from tests.real_model import cached_model

pytestmark = pytest.mark.slow

TOKENS = 32
# The goal is 1.5x (BENCHMARKS.md, "On a busy host"); the test fails well before the 3-22x it guards against.
MAX_RATIO = 2.5

# Hugging Face's greedy generate of TOKENS tokens in a process of its own, the model loaded and warmed first:
# it prints "ready", and then the seconds of one generate per line it reads.
_HF = """
import sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
def gen(ids):
    ids = torch.tensor([ids])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(sys.argv[2]),
                             min_new_tokens=int(sys.argv[2]), do_sample=False)
        return time.perf_counter() - t
gen(list(range(10, 40)))
print("ready", flush=True)
for line in sys.stdin:
    print(gen([int(x) for x in line.split(",")]), flush=True)
"""


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


@contextlib.contextmanager
def hugging_face(model: Path) -> Iterator[Callable[[int], float]]:
    """The seconds of Hugging Face's generate for a prompt's seed, in a process of its own (`_HF`)."""
    hf = subprocess.Popen([sys.executable, "-c", _HF, str(model), str(TOKENS)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    assert hf.stdin is not None and hf.stdout is not None
    stdin, stdout = hf.stdin, hf.stdout

    def seconds(seed: int) -> float:
        stdin.write(",".join(map(str, _prompt(seed))) + "\n")
        stdin.flush()
        return float(stdout.readline())

    try:
        assert stdout.readline().strip() == "ready"
        yield seconds
    finally:
        hf.kill()
        hf.wait()


def _prompt(seed: int) -> list[int]:
    return [(37 * i + 11 * seed) % 40000 + 100 for i in range(40)]


def test_an_answer_beside_two_busy_loops_costs_about_what_hugging_face_does(request: pytest.FixtureRequest,
                                                                              tmp_path: Path) -> None:
    from client import Client

    model = cached_model(request.config)
    decode, prefill, store = free_ports(3)
    up_args = ["--data-dir", str(tmp_path / "data"), "--model", str(model), "--decode-port", str(decode),
               "--prefill-port", str(prefill), "--store-port", str(store), "--no-http"]
    # Both as deployed: OpenMP's own wait policy, not the suite's (tests.processes.openmp_as_deployed).
    with openmp_as_deployed(), hugging_face(model) as hf_s, running_up(up_args), \
            Client(f"127.0.0.1:{decode}", timeout_s=600) as client:
        def kvserve_s(seed: int) -> float:
            t = time.perf_counter()
            r = client.generate(token_ids=_prompt(seed), max_tokens=TOKENS, ignore_eos=True)
            assert r.usage.completion_tokens == TOKENS
            return time.perf_counter() - t

        kvserve_s(0)  # warm-up: the first steps of each shape
        idle = kvserve_s(1), hf_s(1)
        with busy_loops(2):  # each twice, in turn: the loops' share of the cores comes and goes
            runs = [(kvserve_s(seed), hf_s(seed)) for seed in (2, 3)]
        busy = sum(k for k, _ in runs), sum(h for _, h in runs)
    print(f"\n{TOKENS} tokens, kvserve / Hugging Face: idle {idle[0]:.2f} / {idle[1]:.2f} s = "
          f"{idle[0] / idle[1]:.2f}x; beside two busy loops (twice) {busy[0]:.2f} / {busy[1]:.2f} s = "
          f"{busy[0] / busy[1]:.2f}x")
    assert busy[0] / busy[1] <= MAX_RATIO
