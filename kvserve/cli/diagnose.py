"""Why a call to a kvserve server failed, when the cause is how the server is set up (TLS, client
certificates), in a sentence that names the fix: the CLI's messages. gRPC says only "Socket closed" to a
plaintext call of a TLS server, or to a TLS call without the client certificate an mTLS server requires;
`speaks` dials the server to tell which."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Literal

import grpc

from client import local
from client.client import SERVER_SAYS
from client.local import Layout

Speaks = Literal["nothing", "plaintext", "tls", "mtls"]
PROBE_TIMEOUT_S = 2.0  # to connect and shake hands
ALERT_WAIT_S = 0.5  # for an mTLS server's alert after the handshake, on loopback or a LAN
# gRPC's words for a call that never reached the service: only these are worth a probe. A server's own
# UNAVAILABLE ("shutting down", "the prefill service ... is unavailable") says enough.
TRANSPORT_FAILURES = ("Socket closed", "failed to connect", "Connection refused", "handshake", "Handshake",
                      "connections to all backends failing")


def speaks(addr: str, timeout_s: float = PROBE_TIMEOUT_S) -> Speaks | None:
    """What the server at HOST:PORT answers a TLS handshake that checks no certificate and presents none:
    "nothing" when nothing listens; "plaintext" when it answers in something else; "mtls" when it refuses
    the handshake for want of a client certificate, or closes the connection right after it (a TLS 1.3
    server refuses a missing certificate then); "tls" when it speaks on (or waits, as an HTTP server does).
    None when it cannot tell (a unix socket, no answer)."""
    host, _, port = addr.rpartition(":")
    if not port.isdigit() or host.startswith("unix"):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except ConnectionRefusedError:
        return "nothing"
    except OSError:
        return None
    with raw:
        try:
            tls = context.wrap_socket(raw)
        except ssl.SSLError as exc:
            if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
                return "plaintext"
            return "mtls" if exc.reason and "ALERT_CERTIFICATE_REQUIRED" in exc.reason else None
        except OSError:  # reset, closed or no answer during the handshake
            return None
        with tls:
            tls.settimeout(ALERT_WAIT_S)
            try:
                return "tls" if tls.recv(1) else "mtls"
            except TimeoutError:
                return "tls"
            except OSError:  # an alert (certificate required), a reset
                return "mtls"


@dataclass(frozen=True, slots=True)
class Dialed:
    """How a command called a server: its address, over TLS or not, the CA file it trusted (None: the system's),
    whether it presented a client certificate, whether the call needs a bearer token (the front door's API),
    and the credentials of the `kvserve up` known to serve the address (None: none known), whose files a fix
    names."""

    addr: str
    tls: bool = False
    tls_ca: str | None = None
    client_cert: bool = False
    needs_token: bool = False
    known: Layout | None = None
    nobody: str = ""  # said after "nothing listens at ADDR": e.g. where the command looked for a `kvserve up`

    def ca(self) -> str:
        return str(self.known.ca) if self.known else "CA.pem (DATA_DIR/certs/ca.pem of the server's `kvserve up`)"

    def cert_flags(self) -> str:
        if self.known is None:
            return ("--tls-cert CERT.pem --tls-key KEY.pem (a certificate from the server's CA, e.g. "
                    "DATA_DIR/admin/admin.pem and admin-key.pem of its `kvserve up`)")
        cert, key = self.known.admin_cert
        return f"--tls-cert {cert} --tls-key {key}"

    def token_hint(self) -> str:
        where = f"; the admin's is in {self.known.admin_token}" if self.known else ""
        return f"a bearer token with --token TOKEN or KVSERVE_TOKEN (`kvserve token TENANT` makes one{where})"


def unavailable(dialed: Dialed, details: str) -> str | None:
    """What an UNAVAILABLE call with gRPC's `details` means, and its fix, when the cause is how the server or
    the call is set up; None when it is not (the server is down, restarting, ...: gRPC's words say enough, and
    so do the server's own, e.g. the placeholder of a service `kvserve up` starts again, which the client
    quotes after a broken stream: SERVER_SAYS)."""
    addr = dialed.addr
    if SERVER_SAYS in details:
        return None
    trusted = "the system's CAs" if dialed.tls_ca is None else f"the CA in {dialed.tls_ca}"
    if "CERTIFICATE_VERIFY_FAILED" in details and dialed.tls:
        fix = f": pass --tls-ca {dialed.known.ca}" if dialed.known and str(dialed.known.ca) != dialed.tls_ca else (
            ": pass --tls-ca with the CA that signed it")
        return f"the certificate of the server at {addr} is not signed by {trusted}{fix}"
    if "DNS" in details or not any(words in details for words in TRANSPORT_FAILURES):
        return None
    server = speaks(addr)
    if server == "nothing":
        return f"nothing listens at {addr}{dialed.nobody or ' (connection refused)'}"
    if server == "plaintext" and dialed.tls:
        return (f"the server at {addr} speaks plaintext, not TLS (an `up --insecure`?): call it without --tls-ca "
                "(nor KVSERVE_TLS_CA)" + (", --tls-cert, --tls-key" if dialed.client_cert else ""))
    # Without TLS flags, `kvserve health` and `stats` ask a server of a `kvserve up` on this host with the admin
    # certificate that up registered for its port (client/local.py): say so where none is registered.
    unregistered = "" if dialed.known else (
        f" (without them, `kvserve health` and `stats` present the admin certificate of the `kvserve up` on this host "
        f"that serves {addr}: none is registered in {local.home() / 'up'} or in --data-dir's up.json)")
    if server in ("tls", "mtls") and not dialed.tls:
        if server == "mtls":
            return (f"the server at {addr} speaks TLS and takes only callers with a certificate from its CA: pass "
                    f"--tls-ca {dialed.ca()} {dialed.cert_flags()}{unregistered}")
        token = f" and {dialed.token_hint()}" if dialed.needs_token else ""
        return f"the server at {addr} speaks TLS: pass --tls-ca {dialed.ca()}{token}"
    if server == "mtls" and not dialed.client_cert:
        return (f"the server at {addr} takes only callers with a certificate from its CA, and this call presented "
                f"none: pass {dialed.cert_flags()}{unregistered}")
    if server == "mtls" and "Socket closed" in details:  # closed right after the handshake: the certificate
        return (f"the server at {addr} did not take the client certificate this call presented (--tls-cert): it "
                f"takes only certificates signed by its own CA: pass {dialed.cert_flags()}")
    return None


def explain(dialed: Dialed, code: grpc.StatusCode, details: str) -> str:
    """The CLI's one-line message for a failed call: the fix where the cause is how things are set up, else
    the status and gRPC's words."""
    if code == grpc.StatusCode.UNAVAILABLE and (why := unavailable(dialed, details)) is not None:
        return why
    if code == grpc.StatusCode.UNAUTHENTICATED:
        reason = details.split(": send metadata", 1)[0]  # the server's words for RPC users name no flag
        return f"{reason}: pass {dialed.token_hint()}"
    return f"{code.name}: {details}"
