"""TLS between the services: settings, credentials and channels (`kvserve certs`, in kvserve/rpc/certs.py, makes
the certificates).

A service given a certificate and its key (--tls-cert, --tls-key) serves TLS. Given the CA that signs
the services' certificates as well (--tls-ca), the internal servers (store, prefill) accept only
callers presenting a certificate that CA signed (mTLS), and each service presents its own certificate
when it calls another. The front door (decode) serves TLS without asking its callers for a
certificate: they are tenants, known by their bearer tokens (docs/DESIGN.md, "Tenants and trust").

Clients check the server's certificate against the address they dial, so a certificate names every
host its service is reached by; `kvserve certs` (kvserve/rpc/certs.py) makes such certificates.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # cryptography is imported where a file is checked: plaintext services never load it
    from cryptography import x509

ENV_CERT, ENV_KEY, ENV_CA = "KVSERVE_TLS_CERT", "KVSERVE_TLS_KEY", "KVSERVE_TLS_CA"


class TLSError(ValueError):
    """A TLS setting that cannot work; the message names the file and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """A service's TLS settings, as PEM bytes: its certificate (chain) and private key, which it serves
    and presents to the services it calls, and the CA it trusts.

    Without a CA, a server asks no client certificate and a client checks servers against the
    system's roots; without a certificate, a client presents none (enough for the front door). Build
    it with `load`, which checks the files.
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    source: str = ""  # the files, for log lines
    paths: tuple[str | None, str | None, str | None] = (None, None, None)  # cert, key, CA: for the metrics server

    @classmethod
    def load(cls, cert: str | Path | None = None, key: str | Path | None = None,
             ca: str | Path | None = None) -> TLSConfig:
        """Reads and checks the PEM files; TLSError names the file and the problem (missing, not
        readable, not PEM, the key not the certificate's, expired)."""
        if (cert is None) != (key is None):
            raise TLSError("a TLS certificate and its private key go together (--tls-cert and --tls-key): "
                           "give both or neither")
        cert_pem = key_pem = ca_pem = None
        if cert is not None and key is not None:
            cert_pem, leaf = read_certificate(Path(cert), "TLS certificate (--tls-cert)")
            key_pem = read_private_key(Path(key), leaf, Path(cert), "TLS private key (--tls-key)")
        if ca is not None:
            ca_pem, _ = read_certificate(Path(ca), "TLS CA (--tls-ca)")
        source = ", ".join(f"{what} {path}" for what, path in (("cert", cert), ("CA", ca)) if path is not None)
        def path(p: str | Path | None) -> str | None:
            return None if p is None else str(p)

        return cls(cert_pem, key_pem, ca_pem, source, (path(cert), path(key), path(ca)))

    @property
    def has_identity(self) -> bool:
        return self.cert is not None and self.key is not None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TLSError(f"{what} {path}: no such file (`kvserve certs DIR` makes them)") from None
    except IsADirectoryError:
        raise TLSError(f"{what} {path}: is a directory, not a PEM file") from None
    except PermissionError:
        raise TLSError(f"{what} {path}: cannot read it (permission denied for uid {os.getuid()})") from None
    except OSError as exc:
        raise TLSError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None


def read_certificate(path: Path, what: str) -> tuple[bytes, x509.Certificate]:
    """The file's bytes and its first certificate; TLSError, starting with `what` and the path, when it
    cannot be read, holds no PEM certificate or has expired."""
    from cryptography import x509

    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        hint = " (it holds a private key: are --tls-cert and --tls-key swapped?)" if b"PRIVATE KEY-----" in data else ""
        raise TLSError(f"{what} {path}: not a PEM certificate (no valid -----BEGIN CERTIFICATE----- block){hint}") from None
    expiry = certs[0].not_valid_after_utc
    if expiry < datetime.datetime.now(datetime.UTC):
        raise TLSError(f"{what} {path}: expired on {expiry:%Y-%m-%d}; make new ones (`kvserve certs DIR --force`)")
    return data, certs[0]


def read_private_key(path: Path, cert: x509.Certificate, cert_path: Path, what: str) -> bytes:
    """The file's bytes; TLSError when it cannot be read, is not an unencrypted PEM private key or is not
    the key of `cert` (read from `cert_path`)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise TLSError(f"{what} {path}: is encrypted; a service needs it unencrypted (keep the file 0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TLSError(f"{what} {path}: not a PEM private key (no valid -----BEGIN PRIVATE KEY----- block)") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, spki):
        raise TLSError(f"{what} {path}: is not the key of the certificate {cert_path}")
    return data


def server_credentials(tls: TLSConfig, *, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """TLS with the service's certificate; with a CA and `require_client_cert`, callers must present a
    certificate that CA signed (the internal servers). The front door passes require_client_cert=False."""
    if tls.cert is None or tls.key is None:
        raise TLSError("a server needs its own certificate and key to serve TLS (--tls-cert, --tls-key)")
    mutual = require_client_cert and tls.ca is not None
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca if mutual else None,
                                       require_client_auth=mutual)


def describe(tls: TLSConfig | None, *, require_client_cert: bool = True) -> str:
    """One line for a server's start log: plaintext, TLS, or mTLS."""
    if tls is None:
        return "plaintext gRPC, no TLS (--tls-cert, --tls-key, --tls-ca turn it on)"
    if require_client_cert and tls.ca is not None:
        return f"mTLS: callers must present a certificate from the CA ({tls.source})"
    why = "no --tls-ca" if tls.ca is None else "callers are not asked for a certificate"
    return f"TLS, {why} ({tls.source})"


def channel(addr: str, options: Sequence[tuple[str, Any]] = (), tls: TLSConfig | None = None) -> grpc.Channel:
    """A channel to another service: TLS, checking the server against the CA and presenting this
    service's certificate, when `tls` is set; plaintext otherwise."""
    if tls is None:
        return grpc.insecure_channel(addr, options=list(options))
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                               certificate_chain=tls.cert)
    return grpc.secure_channel(addr, credentials, options=list(options))
