"""The tests are isolated from the developer's stack (issue 57): tests/conftest.py gives the session its own data
dir and KVSERVE_HOME, which every process the tests start inherits. Here the CLI, as a process, runs in a folder
whose data/up.json names a live `kvserve up`, with a HOME whose ~/.kvserve registers that up's credentials for
the ports it calls, and finds neither: the servers it calls are plaintext, so the decoy's certificates would
fail each call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import local
from client.local import HOME_ENV, Layout
from kvserve.engine.fetch import DATA_DIR_ENV, default_data_dir
from kvserve.stack.credentials import ensure
from kvserve.stack.status import STATUS_FILE, ServiceStatus, UpStatus, no_up, read_status, write_status
from kvstore.config import StoreConfig
from kvstore.server import StoreServer
from tests.fake_decode import FakeServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store() -> Iterator[StoreServer]:
    server = StoreServer(StoreConfig(shm=False))
    server.start()
    yield server
    server.stop(grace_s=0.5)


def write_decoy_up(data_dir: Path, services: dict[str, str], layout: Layout) -> None:
    """DATA_DIR/up.json of a secure `kvserve up` (this process, so it reads as running) serving `services`."""
    statuses = {name: ServiceStatus("running", os.getpid(), addr, 0, 0.0, None, None, None)
                for name, addr in services.items()}
    data_dir.mkdir(parents=True)
    write_status(data_dir / STATUS_FILE, UpStatus(os.getpid(), 0.0, 0.0, services["decode"], statuses,
                                                  credentials=str(layout.root), ca=str(layout.ca),
                                                  admin_token=str(layout.admin_token)))


def test_the_cli_reads_neither_the_data_dir_nor_the_home_it_runs_in(
        tmp_path: Path, store: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    session_data, session_home = Path(os.environ[DATA_DIR_ENV]), Path(os.environ[HOME_ENV])
    for folder in (session_data, session_home):
        assert not folder.is_relative_to(ROOT) and not folder.is_relative_to(Path.home())
    work, home = tmp_path / "work", tmp_path / "home"
    decoy = ensure(tmp_path / "decoy")[0]
    with FakeServer() as front:
        write_decoy_up(work / "data", {"kvstore": store.address, "decode": front.addr}, decoy)
        with monkeypatch.context() as m:
            m.setenv(HOME_ENV, str(home / ".kvserve"))
            local.register([store.port, front.port], decoy.root)
            # Without the session's variables, both decoys are found.
            m.delenv(HOME_ENV)
            m.delenv(DATA_DIR_ENV)
            m.setenv("HOME", str(home))
            m.chdir(work)
            assert local.find(front.addr) == decoy and read_status(default_data_dir()) is not None

        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_TLS_", "KVSERVE_TOKEN"))}
        env.update(HOME=str(home), PYTHONPATH=str(ROOT))
        commands = {"health": ["health"], "stats": ["stats", "--kvstore", store.address, "--json"],
                    "generate": ["generate", "--addr", front.addr, "--max-tokens", "3", "hi"]}
        procs = {name: subprocess.Popen([sys.executable, "-m", "kvserve.cli", *argv], cwd=work, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for name, argv in commands.items()}
        done = {name: (*proc.communicate(timeout=60), proc.returncode) for name, proc in procs.items()}

    out, err, code = done["health"]
    assert (code, err) == (2, f"health: {no_up(session_data)}: give ADDR, or start one with `kvserve up`\n"), out
    out, err, code = done["stats"]
    assert code == 0, err
    report = json.loads(out)
    assert "up" not in report and report["kvstore"]["tiers"], report  # asked in plaintext, no up.json shown
    out, err, code = done["generate"]
    assert (code, out) == (0, "xxx\n"), err  # plaintext: neither the decoy's CA nor its token
