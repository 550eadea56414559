"""Tenants bound to credentials at the front door (docs/DESIGN.md, "Tenants and trust").

A tokens file maps bearer tokens to tenants, one line per token: ``TENANT_ID SHA256_HEX_OF_TOKEN``
(``#`` starts a comment; blank lines are skipped). Tokens are stored only as their sha256; a
presented token is hashed and compared in constant time with every entry. ``kvserve token`` (the
`main` here) issues tokens.

The tenant, not the client, fixes the cache namespace: its salt is HMAC-SHA256 of the tenant id under
a server secret, and the client's ``cache_salt`` only narrows inside it (`TenantSalts`). The secret
lives in a file beside the tokens file (``<tokens file>.secret``, made by the first ``kvserve token``)
or wherever ``--auth-secret-file`` says; every decode replica must share it, and it is read once at
start, because another secret means other namespaces (a cold cache). The tokens file is re-read on
SIGHUP; a file that does not parse then leaves the old table in place.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvserve.rpc.errors import PermissionDenied, ServiceError
from kvserve.rpc.server import refusing

log = logging.getLogger(__name__)

TOKENS_ENV = "KVSERVE_AUTH_TOKENS"
SECRET_ENV = "KVSERVE_AUTH_SECRET_FILE"
SERVICE_TOKENS_ENV = "KVSERVE_SERVICE_TOKENS"
# Internal APIs on the front door's port: only a service's token (--service-tokens) is answered, never a tenant's.
INTERNAL_METHOD_PREFIXES = ("/kvserve.v1.DecodeReplica/",)
# On an internal call made for a tenant (the router asking for a prompt's hashes in the caller's namespace),
# the tenant's own "Bearer <token>", as the caller sent it.
ON_BEHALF_OF = "kvserve-on-behalf-of"
HOW_TO_AUTHENTICATE = "send metadata authorization: Bearer <token>; tokens are issued with `kvserve token`"
# Services a balancer or an operator reaches without a token.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
TENANT_ID = re.compile(r"[A-Za-z0-9._@:+=-]{1,128}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
MIN_SECRET_CHARS = 32

_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvserve_tenant", default=None)


class AuthConfigError(ValueError):
    """A tokens or secret file that cannot be used; the message names the file, the line and the fix."""


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


def current_tenant() -> str | None:
    """The tenant of the RPC this code runs in, set by `AuthInterceptor`; None without auth."""
    return _tenant.get()


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class TokenTable:
    """(tenant, sha256 of its token) pairs, as a tokens file lists them."""

    entries: tuple[tuple[str, bytes], ...] = ()

    def tenant_of(self, token: str) -> str | None:
        """The tenant whose token this is, or None. Every entry is compared, in constant time, whichever
        matches: the time taken does not tell which entry (or whether a prefix of a hash) matched."""
        digest = token_digest(token)
        found: str | None = None
        for tenant, expected in self.entries:
            if hmac.compare_digest(digest, expected):
                found = tenant
        return found

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(tenant for tenant, _ in self.entries)


def check_tenant_id(tenant: str) -> str:
    if not TENANT_ID.fullmatch(tenant):
        raise AuthConfigError(f"tenant id {tenant!r} is not 1-128 characters of letters, digits and . _ @ : + = -")
    return tenant


def parse_tokens(text: str, source: str = "tokens file") -> TokenTable:
    """The table of a tokens file's text; AuthConfigError naming `source` and the line when one is wrong."""
    entries: list[tuple[str, bytes]] = []
    seen: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        fields = line.split()
        if len(fields) != 2:
            raise AuthConfigError(f"{where}: expected 'TENANT_ID SHA256_HEX_OF_TOKEN', got {len(fields)} field(s)")
        tenant, hex_digest = fields
        try:
            check_tenant_id(tenant)
        except AuthConfigError as exc:
            raise AuthConfigError(f"{where}: {exc}") from None
        if not _SHA256_HEX.fullmatch(hex_digest):
            raise AuthConfigError(f"{where}: the second field must be the sha256 of the token as 64 hex digits "
                                  "(never the token itself; `kvserve token` writes it)")
        digest = bytes.fromhex(hex_digest)
        if digest in seen:
            raise AuthConfigError(f"{where}: the same token hash as line {seen[digest]}: one token, one tenant")
        seen[digest] = number
        entries.append((tenant, digest))
    return TokenTable(tuple(entries))


def load_tokens(path: Path) -> TokenTable:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read tokens file {path}: {exc}") from None
    return parse_tokens(text, str(path))


def default_secret_path(tokens_path: Path) -> Path:
    """Where `kvserve token` puts the server secret, and decode looks for it, by default."""
    return tokens_path.with_name(tokens_path.name + ".secret")


def load_secret(path: Path) -> bytes:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise AuthConfigError(
            f"no server secret at {path}: it keys every tenant's cache namespace, and every decode replica must "
            "share it. `kvserve token` creates it beside the tokens file; or give --auth-secret-file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read the server secret {path}: {exc}") from None
    if len(text) < MIN_SECRET_CHARS:
        raise AuthConfigError(f"the server secret {path} has {len(text)} characters, fewer than {MIN_SECRET_CHARS}: "
                              "write a long random one (`python -c 'import secrets; print(secrets.token_hex(32))'`)")
    if readable_by_others(path.stat()):
        log.warning("the server secret %s can be read by other users: chmod 600 it", path)
    return text.encode("utf-8")


def readable_by_others(st: os.stat_result) -> bool:
    """Whether a secret file with this stat is open to other users: to everyone, or to a group this process
    is not in as its own (a Kubernetes Secret mounted 0440 for the pod's fsGroup is not)."""
    return bool(st.st_mode & stat.S_IRWXO or (st.st_mode & stat.S_IRWXG and st.st_gid != os.getegid()))


def private_folder(path: Path, files: tuple[str, ...] = ()) -> None:
    """Makes folder `path` (and its parents) if missing, and makes it and the `files` in it that exist its
    user's alone (0700, 0600): a folder an older version made, or made under a wider umask, is narrowed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    for name in files:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path / name, 0o600)


@dataclass(frozen=True, slots=True)
class TenantSalts:
    """The cache salt of a tenant's request: HMAC-SHA256(secret, tenant) in hex, then NUL, then the
    client's salt. Without the secret nobody (a client reaching prefill, a reader of the store's
    events) can name a tenant's namespace; the client's salt cannot reach another tenant's."""

    secret: bytes

    def salt(self, tenant: str, client_salt: str) -> str:
        key = hmac.new(self.secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()
        return f"{key}\x00{client_salt}"


class Authenticator:
    """The tokens file's current table; `reload` re-reads it, keeping the old table when it fails."""

    def __init__(self, tokens_path: Path, table: TokenTable | None = None, what: str = "tenants") -> None:
        self.tokens_path = tokens_path
        self._table = table if table is not None else load_tokens(tokens_path)
        self._reload_lock = threading.Lock()
        if not self._table.entries:
            log.warning("the tokens file %s lists no token: every request of %s is refused", tokens_path, what)

    @property
    def table(self) -> TokenTable:
        return self._table

    def tenant_of(self, token: str) -> str | None:
        return self._table.tenant_of(token)

    def reload(self) -> bool:
        """Re-reads the tokens file; on failure logs why and keeps serving the old table."""
        with self._reload_lock:
            try:
                table = load_tokens(self.tokens_path)
            except AuthConfigError as exc:
                log.error("tokens file not reloaded, the previous %d token(s) stay in use: %s",
                          len(self._table.entries), exc)
                return False
            self._table = table  # one reference swap: a lookup sees the old table or the new one
        log.info("reloaded %s: %d token(s) of %d tenant(s)", self.tokens_path, len(table.entries), len(table.tenants))
        return True


def _bearer_token(metadata: Sequence[tuple[str, Any]] | None, key: str = "authorization") -> str | None:
    """The token of the first `key` entry ('' when it is not 'Bearer <token>'), None when there is none."""
    for name, value in metadata or ():
        if name.lower() != key:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token else ""
    return None


def _as_tenant(fn: Callable[..., Any], tenant: str, *, streaming: bool) -> Callable[..., Any]:
    """`fn` run with `current_tenant()` giving `tenant`: each step of it runs in a context of its own,
    so that nothing is left set on the worker thread once the RPC ends."""
    if streaming:

        def stream(request: Any, context: grpc.ServicerContext) -> Any:
            ctx = contextvars.copy_context()
            ctx.run(_tenant.set, tenant)
            responses = ctx.run(fn, request, context)
            try:
                while True:
                    try:
                        item = ctx.run(next, responses)
                    except StopIteration:
                        return
                    yield item
            finally:
                close = getattr(responses, "close", None)
                if close is not None:
                    ctx.run(close)

        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        ctx = contextvars.copy_context()
        ctx.run(_tenant.set, tenant)
        return ctx.run(fn, request, context)

    return unary


def _token_problem(token: str | None, what: str) -> str:
    if token is None:
        return f"this service requires {what}"
    if not token:
        return "the authorization metadata is not 'Bearer <token>'"
    return "the bearer token is not valid (unknown or revoked)"


class AuthInterceptor(grpc.ServerInterceptor):
    """Bearer tokens at the front door. Health and reflection are open. The internal APIs
    (`INTERNAL_METHOD_PREFIXES`) answer only a token from the services' table, and a tenant's token gets
    PERMISSION_DENIED; a call a service makes for a tenant names the tenant's token in `ON_BEHALF_OF`. Every
    other RPC needs a tenant's token when `tenants` is set (open otherwise). An accepted RPC runs with
    `current_tenant()` set."""

    def __init__(self, tenants: Authenticator | None, services: Authenticator | None = None) -> None:
        self.authenticator = tenants
        self.services = services

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        token = _bearer_token(metadata)
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        kind = next(k for k in kinds if getattr(handler, k) is not None)
        tenant: str | None = None
        if method.startswith(INTERNAL_METHOD_PREFIXES):
            service = self.services.tenant_of(token) if self.services is not None and token else None
            if service is None:
                if token and self.authenticator is not None and self.authenticator.tenant_of(token) is not None:
                    log.warning("refused %s to a tenant's token: internal API", method)
                    return refusing(PermissionDenied(
                        f"{method} is internal: it answers only kvserve's own services (a token from "
                        "decode's --service-tokens, e.g. the router's), never a tenant's token"))
                problem = _token_problem(token, "a service's bearer token")
                log.info("refused %s: %s", method, problem)
                return refusing(Unauthenticated(
                    f"{problem}: {method} is internal; services present a token from decode's "
                    "--service-tokens file (`kvserve credentials` makes the router's)"))
            on_behalf = _bearer_token(metadata, key=ON_BEHALF_OF)
            if on_behalf is not None and self.authenticator is not None:
                tenant = self.authenticator.tenant_of(on_behalf) if on_behalf else None
                if tenant is None:
                    return refusing(Unauthenticated(
                        f"{_token_problem(on_behalf, 'a bearer token')} (the caller's, in "
                        f"{ON_BEHALF_OF}): {HOW_TO_AUTHENTICATE}"))
        elif self.authenticator is not None:
            tenant = self.authenticator.tenant_of(token) if token else None
            if tenant is None:
                problem = _token_problem(token, "a bearer token")
                log.info("refused %s: %s", method, problem)
                return refusing(Unauthenticated(f"{problem}: {HOW_TO_AUTHENTICATE}"))
        if tenant is None:
            return handler
        return handler._replace(**{kind: _as_tenant(getattr(handler, kind), tenant,
                                                    streaming=kind.endswith("_stream"))})


# --- the decode service's flags -----------------------------------------------------------------


def add_auth_flags(p: argparse.ArgumentParser) -> None:
    """--auth-tokens and --auth-secret-file, each defaulting to its environment variable."""
    p.add_argument("--auth-tokens", type=Path, default=os.environ.get(TOKENS_ENV) or None, metavar="FILE",
                   help=f"require a bearer token listed in FILE (lines 'TENANT_ID SHA256_HEX'; `kvserve token` adds "
                        f"them; SIGHUP re-reads it); each tenant gets its own cache namespace (default: ${TOKENS_ENV}; "
                        "without it, auth is off)")
    p.add_argument("--auth-secret-file", type=Path, default=os.environ.get(SECRET_ENV) or None, metavar="FILE",
                   help="server secret that keys each tenant's cache namespace, the same on every decode replica "
                        f"(default: ${SECRET_ENV}, else the tokens file's name plus .secret, which `kvserve token` "
                        "creates)")
    p.add_argument("--service-tokens", type=Path, default=os.environ.get(SERVICE_TOKENS_ENV) or None, metavar="FILE",
                   help="tokens of kvserve's own services (the router), in the tokens file's format ('NAME "
                        "SHA256_HEX'): only these may call the internal API, DecodeReplica; a tenant's token gets "
                        f"PERMISSION_DENIED (default: ${SERVICE_TOKENS_ENV}; without it and without --auth-tokens, "
                        "the internal API is open)")


@dataclass(frozen=True, slots=True)
class Auth:
    """What a front door with auth on needs: the tenants' tokens and salts (None: Generate is open to
    anyone) and the services' tokens (None: the internal APIs answer no one), and the interceptor."""

    authenticator: Authenticator | None
    salts: TenantSalts | None
    services: Authenticator | None = None

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [AuthInterceptor(self.authenticator, self.services)]

    def reload_on_sighup(self) -> None:
        """Re-reads both tokens files on SIGHUP. Call from the main thread; the files are read on a thread
        of their own, not in the handler (which interrupts whatever the main thread runs)."""
        tables = [a for a in (self.authenticator, self.services) if a is not None]

        def reload() -> None:
            for table in tables:
                table.reload()

        def handle(_signum: int, _frame: Any) -> None:
            threading.Thread(target=reload, name="auth-reload", daemon=True).start()

        signal.signal(signal.SIGHUP, handle)


def auth_from_args(args: argparse.Namespace, service: str) -> Auth | None:
    """The Auth the flags ask for, or None (auth off, which is logged as a warning); AuthConfigError
    when a file is missing or wrong."""
    tokens: Path | None = args.auth_tokens
    secret_path: Path | None = args.auth_secret_file
    services_path: Path | None = args.service_tokens
    if tokens is None and secret_path is not None:
        raise AuthConfigError("--auth-secret-file is given without --auth-tokens: give both to turn auth on")
    if tokens is None and services_path is None:
        log.warning("auth is off: anyone who reaches the %s service is served, chooses its own cache_salt, and may "
                    "call its internal API (DecodeReplica: the pool's block hashes, its load); turn it on with "
                    "--auth-tokens FILE and --service-tokens FILE (`kvserve credentials --help`)", service)
        return None
    authenticator = salts = None
    if tokens is not None:
        authenticator = Authenticator(tokens)
        salts = TenantSalts(load_secret(secret_path or default_secret_path(tokens)))
        log.info("auth is on: %d token(s) of %d tenant(s) from %s", len(authenticator.table.entries),
                 len(authenticator.table.tenants), tokens)
    else:
        log.warning("no --auth-tokens: anyone who reaches the %s service is served and chooses its own "
                    "cache_salt", service)
    services = Authenticator(services_path, what="services") if services_path is not None else None
    if services is None:
        log.info("no --service-tokens: the internal API (DecodeReplica) answers no one, so no router can place "
                 "requests by prefix on this replica")
    return Auth(authenticator, salts, services)


# --- `kvserve token` ----------------------------------------------------------------------------


def write_new_file(path: Path, text: str) -> bool:
    """Creates `path` (mode 0600) holding `text`; False when it already exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def add_token(tokens_path: Path, tenant: str) -> str:
    """Appends a new random token of `tenant` (its sha256) to the tokens file, created 0600 if missing,
    and returns the token. A tokens file that does not parse is left as it is (AuthConfigError)."""
    check_tenant_id(tenant)
    existing = load_tokens(tokens_path) if tokens_path.exists() else TokenTable()
    token = secrets.token_urlsafe(32)
    # A duplicate is astronomically unlikely (the file refuses them); a leading dash would read as a flag
    # in `--token TOKEN`.
    while existing.tenant_of(token) is not None or token.startswith("-"):
        token = secrets.token_urlsafe(32)
    text = tokens_path.read_text(encoding="utf-8") if tokens_path.exists() else ""
    line = f"{tenant} {token_digest(token).hex()}\n"
    fd = os.open(tokens_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line if not text or text.endswith("\n") else "\n" + line)
    return token


def token_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvserve token",
        description="Issues a bearer token for TENANT: appends 'TENANT sha256(token)' to the tokens file (created "
                    "with mode 0600; only the hash is kept) and prints the token once on stdout; keep it, it "
                    "cannot be shown again. The first call also creates the server secret beside the tokens file "
                    "(FILE.secret, 0600), which keys each tenant's cache namespace; copy both files to every decode "
                    "replica. Start decode with `--auth-tokens FILE`; a running one loads new tokens on SIGHUP. "
                    "Clients send metadata 'authorization: Bearer <token>' (`kvserve generate --token`, "
                    "`Client(addr, token=...)` or $KVSERVE_TOKEN). To revoke a token, delete its line and send SIGHUP.",
    )
    ap.add_argument("tenant", metavar="TENANT", help="tenant id: 1-128 letters, digits and . _ @ : + = -; tenants never share KV blocks")
    ap.add_argument("--tokens-file", type=Path, default=os.environ.get(TOKENS_ENV) or None, metavar="FILE",
                    help=f"the tokens file decode reads with --auth-tokens (default: ${TOKENS_ENV})")
    ap.add_argument("--secret-file", type=Path, default=os.environ.get(SECRET_ENV) or None, metavar="FILE",
                    help="the server secret to create if missing (default: the tokens file's name plus .secret)")
    ap.add_argument("--json", action="store_true", help="print {tenant, token, tokens_file, secret_file} as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = token_parser()
    args = ap.parse_args(argv)
    if args.tokens_file is None:
        ap.error(f"give --tokens-file FILE (or set ${TOKENS_ENV})")
    tokens_path: Path = args.tokens_file
    secret_path: Path = args.secret_file or default_secret_path(tokens_path)
    try:
        check_tenant_id(args.tenant)
        if tokens_path.exists():
            load_tokens(tokens_path)  # a broken file is refused before anything is written
        if write_new_file(secret_path, secrets.token_hex(32) + "\n"):
            print(f"kvserve token: created the server secret {secret_path}", file=sys.stderr)
        token = add_token(tokens_path, args.tenant)
    except (AuthConfigError, OSError) as exc:
        print(f"kvserve token: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"tenant": args.tenant, "token": token, "tokens_file": str(tokens_path),
                          "secret_file": str(secret_path)}))
    else:
        print(token)
    print(f"kvserve token: added a token of tenant {args.tenant} to {tokens_path}; a running decode service loads "
          "it on SIGHUP", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
