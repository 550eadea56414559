"""What a person sees in the first hour (issue 29): progress while things start and stop, model text that
cannot drive the terminal, and no noise in the services' logs or in `kvserve certs`' report."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli.commands import main as kvserve
from kvserve.cli.terminal import Progress, printable
from kvserve.rpc.certs import flags
from kvserve.stack.stack import Service, Stack, StackConfig
from tests.polling import wait_until
from tests.stack_fixtures import model_dir


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_printable_escapes_control_characters_but_newline_and_tab() -> None:
    assert printable("a\x1b[2Jb\x07\rc\x7f\x9b\x00") == "a\\x1b[2Jb\\x07\\x0dc\\x7f\\x9b\\x00"
    assert printable("line 1\n\tline 2 é 日本 🙂") == "line 1\n\tline 2 é 日本 🙂"


def test_progress_off_a_terminal_writes_each_message_as_a_line() -> None:
    out = io.StringIO()
    say = Progress(out)
    say("starting decode ...")
    say.note = "3 tokens"  # drawn on a terminal only
    say("decode ready on 127.0.0.1:1 (0.5 s)")
    assert out.getvalue() == "starting decode ...\ndecode ready on 127.0.0.1:1 (0.5 s)\n"


def test_progress_on_a_terminal_rewrites_the_step_until_a_line_replaces_it() -> None:
    out = _Terminal()
    say = Progress(out)
    say("turn 1/6, alice: without the cache\x1b[31m ...")
    say.note = "3/24 tokens"
    wait_until(lambda: "3/24 tokens" in out.getvalue(), message=lambda: repr(out.getvalue()))  # the ticker redraws
    say("   1  alice  2045")
    text = out.getvalue()
    assert text.startswith("\r\x1b[Kturn 1/6, alice: without the cache\\x1b[31m ...")
    assert "\r\x1b[Kturn 1/6, alice: without the cache\\x1b[31m ... 3/24 tokens" in text
    assert text.endswith("\r\x1b[K   1  alice  2045\n") and text.count("\n") == 1


def test_a_stack_reports_its_stop_and_is_quiet_without_a_progress_callback(tmp_path: Path) -> None:
    said: list[str] = []
    config = StackConfig(model_dir=tmp_path, data_dir=tmp_path)
    quiet, loud = Stack(config), Stack(config, progress=said.append)
    for stack in (quiet, loud):
        for name in ("kvstore", "decode"):
            stack.services.append(Service(name, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                                                 text=True), 0, None))
        stack.stop()
    assert said[:2] == ["stopping decode ...", "stopping kvstore ..."]
    assert len(said) == 3 and said[2].startswith("stopped in ") and said[2].endswith(" s")
    loud.stop()  # nothing left to stop: nothing said
    assert len(said) == 3


def test_loading_a_model_draws_no_progress_bar(capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    from kvserve.engine.model import load_model

    path = model_dir("llama")
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as a service finds it (init_tiny_model, run earlier, turns it off)
    try:
        capfd.readouterr()
        load_model(path)
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()  # as it was: only the load is quiet
    finally:
        if not was:
            hf_logging.disable_progress_bar()


def test_certs_for_a_tool_only_print_no_service_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve(["certs", str(tmp_path), "--name", "ops-tool"]) == 0
    out = capsys.readouterr().out
    assert "Start each service" not in out and "ops-tool.pem is a tool's certificate" in out
    assert kvserve(["certs", str(tmp_path), "--name", "router"]) == 0
    out = capsys.readouterr().out
    assert "Start each service" in out and f"  kvserve router {' '.join(flags(tmp_path, 'router'))} ..." in out
