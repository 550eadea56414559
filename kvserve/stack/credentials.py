"""`kvserve credentials DIR`: everything a secure node needs, made once and kept (client/local.py lists
the files). `kvserve up` runs it on its data dir at every start; the compose file's init job and an
operator preparing a Kubernetes Secret run the command.

As with CockroachDB's `cockroach cert` and Elasticsearch 8's first start, security needs no decision:
the first start makes a CA, a certificate per service, an admin token and the secrets, and a later
start finds and reuses them.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from client.local import ADMIN_TENANT, Layout
from kvserve.rpc.auth import AuthConfigError, add_token, private_folder, token_digest, write_new_file
from kvserve.rpc.certs import ADMIN, DEFAULT_NAMES, host_arg, make_certs
from kvserve.rpc.tls import TLSError

ROUTER = "router"


def ensure(root: Path, hosts: Sequence[str] = ()) -> tuple[Layout, list[str]]:
    """Makes in `root` whatever of the node's credentials is missing, keeping what is there; returns the
    layout and what was made (for one line each in a log). TLSError, AuthConfigError or OSError when a file
    there cannot be used."""
    layout = Layout(root)
    made: list[str] = []
    certs = make_certs(layout.certs, DEFAULT_NAMES, hosts, keep_existing=True)
    written = list(certs.written)
    if certs.new_ca:  # those kept were signed by a CA that is gone: nobody would trust them
        made.append(f"a CA in {layout.certs}")
        kept = [name for name in DEFAULT_NAMES if name not in written]
        written += list(make_certs(layout.certs, kept, hosts, force=True).written) if kept else []
    made += [f"the {name} certificate" for name in written]
    private_folder(layout.admin)
    if make_certs(layout.admin, [ADMIN], keep_existing=not certs.new_ca, force=certs.new_ca,
                  ca_dir=layout.certs).written:
        made.append(f"the admin certificate in {layout.admin} (it reads and writes every tenant's blocks)")
    private_folder(layout.auth)
    if write_new_file(layout.tokens_secret, secrets.token_hex(32) + "\n"):
        made.append("the tenants' namespace secret")
    if write_new_file(layout.record_key, secrets.token_hex(32) + "\n"):
        made.append("the store's record key")
    for tokens, name, token_file in ((layout.tokens, ADMIN_TENANT, layout.admin_token),
                                     (layout.service_tokens, ROUTER, layout.router_token)):
        if not token_file.exists():
            write_new_file(token_file, add_token(tokens, name) + "\n")
            made.append(f"{name}'s token ({token_file})")
        elif write_new_file(tokens, f"{name} {token_digest(read_token(token_file)).hex()}\n"):  # the file was lost
            made.append(f"{tokens} with {name}'s token from {token_file} (any other token it held is lost: issue "
                        "it again with `kvserve token`)")
    return layout, made


def read_token(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve credentials",
        description="Make what a secure kvserve node needs in DIR, keeping whatever is already there: certs/ (a CA "
                    f"and a certificate per service: {', '.join(DEFAULT_NAMES)}; one missing from an existing DIR "
                    "is added, signed by its CA), admin/ (the admin "
                    "certificate and the front door's admin token: the master credentials, for operators only), "
                    "auth/ (the tenants' tokens file and namespace secret, the router's service token, the "
                    "store's record key). `kvserve up` does this in its data dir by itself; run it for compose "
                    "or to build a Kubernetes Secret (docs/OPERATIONS.md, \"Security\").")
    p.add_argument("dir", type=Path, help="folder to write into (made if missing)")
    p.add_argument("--san", action="append", type=host_arg, default=[], metavar="HOST",
                   help="another host name or IP address the services are reached by (repeatable); each service's "
                        f"certificate also names the service ({', '.join(DEFAULT_NAMES)}) and localhost")
    p.add_argument("--json", action="store_true", help="print the files as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        layout, made = ensure(args.dir, args.san)
    except (TLSError, AuthConfigError, OSError) as exc:
        print(f"kvserve credentials: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"dir": str(layout.root), "ca": str(layout.ca), "admin_token": str(layout.admin_token),
                          "admin_cert": [str(p) for p in layout.admin_cert], "tokens": str(layout.tokens),
                          "tokens_secret": str(layout.tokens_secret), "service_tokens": str(layout.service_tokens),
                          "router_token": str(layout.router_token), "record_key": str(layout.record_key),
                          "made": made}, indent=2))
        return 0
    for line in made or ["nothing: every file was there"]:
        print(f"made {line}")
    print(f"clients trust {layout.ca}; the admin token is in {layout.admin_token} (tenant {ADMIN_TENANT}); "
          f"`kvserve token TENANT --tokens-file {layout.tokens}` adds a tenant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
