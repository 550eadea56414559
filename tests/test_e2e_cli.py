"""`kvserve up` as a user runs it from a fresh shell: the stack comes up, secure as by default, `kvserve
generate --json` and `kvserve stats --json` answer with no credentials given (they find those `up` made),
OpenAI's SDK is served over HTTPS as README.md shows, and SIGTERM stops every service (a stream in flight ends with UNAVAILABLE or completes; no process
is left behind)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from client.client import KVServeError
from tests.polling import wait_until
from tests.processes import KVSERVE, Up, alive, children, free_ports
from tests.stack_fixtures import BLOCK_SIZE, model_dir, tokens

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[1] / "README.md"
USAGE = README.parent / "docs" / "USAGE.md"

START_TIMEOUT_S = 120


def kvserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


class CliUp(Up):
    """`kvserve up` on free ports and the tests' model, in `tmp` (where the README's examples run)."""

    def __init__(self, tmp: Path) -> None:
        self.decode, self.prefill, self.store, self.http = free_ports(4)
        self.cwd = tmp
        super().__init__(["--data-dir", str(tmp / "data"), "--decode-port", str(self.decode), "--prefill-port",
                          str(self.prefill), "--store-port", str(self.store), "--http-port", str(self.http),
                          "--model", str(model_dir("llama")), "--block-size", str(BLOCK_SIZE)], cwd=tmp)


@pytest.fixture()
def up(tmp_path: Path) -> Iterator[CliUp]:
    u = CliUp(tmp_path)
    try:
        u.wait_ready(START_TIMEOUT_S)
        yield u
    finally:
        u.stop()


def check_the_readme_http_examples_and_a_killed_front(up: CliUp) -> None:
    """The curl command of docs/USAGE.md and the README's `openai` example, run as they are written (in the folder `up` runs in)
    against this `up`; a SIGKILLed HTTP front is started again by `up`, on its port, and answers again."""
    from kvserve.stack.status import read_status

    url = f"https://127.0.0.1:{up.http}/v1"
    assert f"OpenAI API at {url} for model 'model-llama'; HTTPS: trust " in up.output()
    curl, python = readme_http_examples(up.http)
    python = python.replace('"smollm2-135m-instruct"', '"model-llama"')  # this up serves the tests' model folder
    curl = curl.replace('"smollm2-135m-instruct"', '"model-llama"')

    def ask() -> None:
        done = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=120,
                              cwd=up.cwd)
        assert done.returncode == 0, done.stderr
        assert done.stdout.rstrip("\n").rpartition(" ")[2].isdigit(), done.stdout  # the text, the cached tokens

    ask()
    if shutil.which("curl"):
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, cwd=up.cwd)
        assert done.returncode == 0 and "data: [DONE]" in done.stdout, done.stdout + done.stderr
    status = read_status(up.cwd / "data")
    assert status is not None and status.services["http"].pid is not None
    os.kill(status.services["http"].pid, signal.SIGKILL)

    def served_again() -> bool:
        now = read_status(up.cwd / "data")
        return now is not None and now.services["http"].state == "running" and now.services["http"].restarts == 1

    wait_until(served_again, timeout_s=60, interval_s=0.2, message=up.output)
    ask()


def test_up_generate_stats_the_http_api_and_a_clean_stop(up: CliUp) -> None:
    addr = f"127.0.0.1:{up.decode}"
    assert f"ready: front door at {addr}, TLS, admin token in " in up.output()
    services = children(up.proc.pid)
    assert len(services) == 4

    ids = tokens(3 * BLOCK_SIZE + 4, seed=500)
    argv = ["generate", "--json", "--token-ids", ",".join(map(str, ids)), "--max-tokens", "8", "--ignore-eos",
            "--addr", addr]
    results = []
    for _ in range(2):
        done = kvserve(*argv, cwd=up.cwd)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    cold, warm = results
    assert cold["prompt_token_ids"] == ids and len(cold["token_ids"]) == 8 and cold["finish_reason"] == "length"
    assert cold["usage"] == {"prompt_tokens": len(ids), "cached_tokens": 0, "completion_tokens": 8}
    assert warm["usage"]["cached_tokens"] == 3 * BLOCK_SIZE and warm["token_ids"] == cold["token_ids"]
    assert warm["timings"]["ttft_s"] > 0

    done = kvserve("stats", "--kvstore", f"127.0.0.1:{up.store}", "--json", cwd=up.cwd)
    assert done.returncode == 0, done.stderr
    tiers = {t["tier"]: t for t in json.loads(done.stdout)["kvstore"]["tiers"]}
    assert sum(int(t["blocks"]) for t in tiers.values()) >= 3

    check_the_readme_http_examples_and_a_killed_front(up)
    services = children(up.proc.pid)  # the HTTP front's new process among them
    assert len(services) == 4

    # A long stream in flight when the stack is told to stop.
    outcome: list[object] = []
    streaming = threading.Event()

    def stream() -> None:
        with Client(addr, timeout_s=120) as c:
            try:
                for item in c.stream(token_ids=ids, max_tokens=4000, ignore_eos=True):
                    streaming.set()
                    last = item
                outcome.append(last)
            except KVServeError as exc:
                outcome.append(exc)

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(30)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0, up.output()
    reader.join(30)
    assert not reader.is_alive(), "the stream hung after SIGTERM"
    [end] = outcome
    if isinstance(end, KVServeError):
        assert end.code.name == "UNAVAILABLE" and "shutting down" in end.details, end
    assert "stopped" in up.output()
    wait_until(lambda: not any(alive(pid) for pid in services), timeout_s=10, interval_s=0.1,
               message=lambda: f"orphans: {[pid for pid in services if alive(pid)]}")


def readme_http_examples(port: int) -> tuple[str, str]:
    """docs/USAGE.md's curl command for OpenAI's API and the README's `openai` example, on `port` instead of 8000."""
    section = USAGE.read_text().split("## OpenAI's HTTP API", 1)[1].split("\n## ", 1)[0]
    sh = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    py = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert sh and py, "USAGE.md's HTTP API section or the README's tour lost its example"
    return sh.group(1).replace(":8000", f":{port}"), py.group(1).replace(":8000", f":{port}")
