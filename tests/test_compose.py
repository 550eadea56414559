"""docker-compose.yml cannot be run here (no Docker engine); check that each service's command is
one our CLI accepts and that the services point at each other."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"kvstore": "kvstore.__main__", "prefill": "prefill_service.__main__", "decode": "decode_service.__main__"}


def test_compose_commands_parse_with_our_cli() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert set(services) == set(MODULES)
    args = {}
    for name, spec in services.items():
        command, *argv = spec["command"]
        assert command == name
        args[name] = importlib.import_module(MODULES[name]).parser().parse_args(argv)
    assert args["prefill"].kvstore == args["decode"].kvstore == "kvstore:50053"
    assert args["decode"].prefill == "prefill:50052"
    assert args["prefill"].model == args["decode"].model
    # Same-host shared memory needs one IPC namespace for the three containers.
    assert services["prefill"]["ipc"] == services["decode"]["ipc"] == "service:kvstore"
