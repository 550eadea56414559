"""The `kvserve` command. `kvserve health` is what the containers' probes run every few seconds, beside a
service that may be busy: it imports only what asking a health service needs (kvserve/cli/health.py), not what the
other commands do (kvserve/cli/commands.py: the stack, its supervisor, cryptography), which was half its start-up."""

from __future__ import annotations

import os
import sys


def main() -> int:
    if sys.argv[1:2] == ["health"]:
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # gRPC core's log lines would repeat its message (as in cli.py)
        from kvserve.cli.health import main as health

        return health(sys.argv[2:])
    from kvserve.cli.commands import main as cli

    return cli()
