"""README.md's examples, run as a reader runs them. Python blocks run in a subprocess under `-W error`, and the
cheap `kvserve` commands under PYTHONWARNINGS=error, against a `kvserve up` started from the README's own line
on free ports (each default port in a block is swapped for the test's); `make` lines must name Makefile
targets. A block that is none of these fails the test unless NOT_RUN names it, so none goes untested unseen."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from client.local import HOME_ENV
from kvserve.engine.fetch import DATA_DIR_ENV
from tests.processes import KVSERVE, Up, free_ports

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_KVSERVE = ".venv/bin/kvserve"
RUN = ("generate", "stats")  # `kvserve` commands cheap enough to run against the test's `up`
NOT_RUN: frozenset[str] = frozenset()  # blocks (their exact text) deliberately left unrun; none today
# `kvserve up`'s default ports (kvserve/cli/commands.py), in the order of its port flags below.
DEFAULT_PORTS = {"--decode-port": 50051, "--prefill-port": 50052, "--store-port": 50053, "--http-port": 8000}
START_TIMEOUT_S = 120
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # where it starts in README.md, for messages


@dataclass(frozen=True)
class Step:
    """A python block to run, or a `kvserve` command (argv after `kvserve`)."""

    code: str = ""
    argv: tuple[str, ...] = ()


@dataclass
class Plan:
    """What the test does with README's blocks: steps in README order."""

    make_targets: list[str] = field(default_factory=list)
    up: list[str] | None = None  # `kvserve up`'s arguments after `up`
    steps: list[Step] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def shell_commands(text: str) -> list[list[str]]:
    """Each command of a shell block as argv, comments dropped and continued lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def plan(blocks: list[Block]) -> Plan:
    p = Plan()
    for block in blocks:
        if block.text in NOT_RUN:
            continue
        if block.lang == "python":
            p.steps.append(Step(code=block.text))
        elif block.lang in ("sh", "bash", "shell"):
            for argv in shell_commands(block.text):
                if argv[0] == "make" and len(argv) == 2:
                    p.make_targets.append(argv[1])
                elif argv[0] == VENV_KVSERVE and argv[1:2] == ["up"] and p.up is None:
                    p.up = argv[2:]
                elif argv[0] == VENV_KVSERVE and argv[1:2] and argv[1] in RUN:
                    p.steps.append(Step(argv=tuple(argv[1:])))
                else:
                    p.unknown.append(f"README.md line {block.line}: {shlex.join(argv)}")
        else:
            p.unknown.append(f"README.md line {block.line}: a ```{block.lang} block")
    return p


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_every_block_is_run_or_listed_as_not_run() -> None:
    blocks = readme_blocks()
    p = plan(blocks)
    assert not p.unknown, f"README blocks this test neither runs nor lists in NOT_RUN: {p.unknown}"
    assert not NOT_RUN - {b.text for b in blocks}, "NOT_RUN names a block README.md no longer has"
    assert p.up is not None and any(step.code for step in p.steps), "the tour lost `up` or its snippet"


def test_make_lines_name_makefile_targets() -> None:
    p = plan(readme_blocks())
    assert p.make_targets, "README.md names no make target"
    assert set(p.make_targets) <= makefile_targets(), set(p.make_targets) - makefile_targets()


class ReadmeUp(Up):
    """The README's `kvserve up` line, in `cwd`, on free ports and the tests' tiny model."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        from tests.stack_fixtures import BLOCK_SIZE, model_dir

        self.ports = dict(zip(DEFAULT_PORTS, free_ports(len(DEFAULT_PORTS)), strict=True))
        flags = [str(x) for flag, port in self.ports.items() for x in (flag, port)]
        super().__init__([*args, *flags, "--model", str(model_dir("llama")), "--block-size", str(BLOCK_SIZE)],
                         cwd=cwd, env=env)

    def on_test_ports(self, text: str) -> str:
        for flag, default in DEFAULT_PORTS.items():
            text = text.replace(f"127.0.0.1:{default}", f"127.0.0.1:{self.ports[flag]}")
        return text


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    """A reader's shell: `data/` in the working folder, not the test session's data dir."""
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    return {**env, HOME_ENV: str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}


@pytest.fixture()
def up(tmp_path: Path, env: dict[str, str]) -> Iterator[ReadmeUp]:
    args = plan(readme_blocks()).up
    assert args is not None
    u = ReadmeUp(args, tmp_path, env)
    try:
        u.wait_ready(START_TIMEOUT_S)
        yield u
    finally:
        u.stop()


@pytest.mark.slow
def test_the_tour_runs_without_warnings(up: ReadmeUp, tmp_path: Path, env: dict[str, str]) -> None:
    for step in plan(readme_blocks()).steps:
        if step.code:
            done = subprocess.run([sys.executable, "-W", "error", "-c", up.on_test_ports(step.code)], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stderr == "", f"{step.code}\n{done.stderr}"
            if "cached_tokens" in step.code:  # the tour's snippet prints the reply, then its cached prompt tokens
                assert done.stdout.rstrip("\n").rpartition(" ")[2].isdigit(), done.stdout
        else:
            argv = [up.on_test_ports(arg) for arg in step.argv]
            done = subprocess.run([KVSERVE, *argv], cwd=tmp_path, env={**env, "PYTHONWARNINGS": "error"},
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and "Warning" not in done.stderr, f"kvserve {shlex.join(argv)}\n{done.stderr}"
            if argv[0] == "stats":  # it found the `up` running in ./data
                assert f"127.0.0.1:{up.ports['--decode-port']}" in done.stdout, done.stdout
        assert done.stdout.strip(), f"{step} printed nothing"

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0, up.output()
    logs = "".join(log.read_text() for log in (tmp_path / "data" / "logs").glob("*.log"))
    assert "Warning" not in up.output() + logs, up.output() + logs
