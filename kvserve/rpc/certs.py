"""`kvserve certs DIR`: a local CA and a certificate per service for mTLS between kvserve's services
(kvserve/rpc/tls.py uses them).

Each certificate is good as a server's and as a client's (a service presents the same one when it
calls another) and names every host its service is reached by: the service's name (as
docker-compose calls it), localhost, 127.0.0.1, ::1 and each --san. Keys are EC P-256, written 0600.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvserve.rpc.tls import ENV_CA, ENV_CERT, ENV_KEY, TLSError, read_certificate, read_private_key

DEFAULT_NAMES = ("kvstore", "prefill", "decode", "router", "http")  # http: the OpenAI-compatible front (HTTPS)
# Certificates good only as a server's: the HTTP front faces the internet and calls nothing with a certificate,
# so its key, were it stolen, opens no internal service (gRPC refuses a client certificate without the purpose).
SERVER_ONLY = frozenset({"http"})
# The master client certificate: the store and prefill accept it like a service's, so it reads and writes every
# tenant's blocks. `kvserve credentials` keeps it in a folder of its own (client/local.py).
ADMIN = "admin"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_FILE, CA_KEY_FILE = "ca.pem", "ca-key.pem"
CA_MIN_DAYS = 3650

_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_DNS = re.compile(r"(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")


def _service_name(text: str) -> str:
    if not _NAME.fullmatch(text) or text.lower() in ("ca", "ca-key"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable name: letters, digits, '.' and '-' "
                                         "(it names the files and is a host name in the certificate), not 'ca'")
    return text


def host_arg(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    if not _DNS.fullmatch(text):
        hint = " (a host, without :PORT)" if ":" in text else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or an IP address{hint}")
    return text


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(subject: str, issuer: x509.Name | None, public_key: ec.EllipticCurvePublicKey,
             now: datetime.datetime, until: datetime.datetime) -> x509.CertificateBuilder:
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def make_ca(days: int, now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new CA (EC P-256) that may sign service certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder("kvserve CA", None, key.public_key(), now, now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(name: str, hosts: Sequence[str], ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, days: int,
          now: datetime.datetime, *, client: bool = True) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A service certificate (EC P-256) for `hosts`, good as a server's and (`client`) as a client's, signed by
    `ca` and ending no later than it."""
    purposes = [ExtendedKeyUsageOID.SERVER_AUTH, *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
    key = ec.generate_private_key(ec.SECP256R1())
    until = min(now + datetime.timedelta(days=days), ca.not_valid_after_utc)
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (_builder(name, ca.subject, key.public_key(), now, until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(purposes), critical=False)
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _write(path: Path, data: bytes, mode: int) -> None:
    """Writes through a temporary file renamed into place, created with `mode` (never briefly wider)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # the umask may have narrowed it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    cert_path, key_path = directory / CA_FILE, directory / CA_KEY_FILE
    if not cert_path.exists() and not key_path.exists():
        return None
    if not (cert_path.exists() and key_path.exists()):
        present, missing = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise TLSError(f"{present} is there but {missing} is not: restore it, or remove {present} to make a new CA "
                       "(every certificate it signed must then be made again)")
    _, cert = read_certificate(cert_path, "the CA's certificate")
    read_private_key(key_path, cert, cert_path, "the CA's key")
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSError(f"the CA's key {key_path}: not an EC key; `kvserve certs` signs only with a CA it made")
    return cert, key


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve certs",
        description="Make a CA and a certificate per service for mTLS between kvserve's services, in DIR: ca.pem, "
                    "ca-key.pem and NAME.pem, NAME-key.pem for each --name (EC P-256; keys are written 0600). Each "
                    "certificate is a server's and a client's, for NAME, localhost, 127.0.0.1, ::1 and each --san. "
                    "A CA already in DIR is reused, so a certificate added later is trusted by the others; to start "
                    "over, remove DIR. Existing certificates are not replaced without --force.")
    p.add_argument("dir", type=Path, help="folder to write into (made if missing)")
    p.add_argument("--name", action="append", type=_service_name, default=None,
                   help=f"a service to make a certificate for; repeatable (default: {' '.join(DEFAULT_NAMES)}). "
                        f"'{ADMIN}' (or any name that no service runs as) is a tool's: with it, a caller reads and "
                        "writes every tenant's blocks in the store, so keep it where only operators can read it")
    p.add_argument("--san", action="append", type=host_arg, default=[], metavar="HOST",
                   help="another host name or IP address the services are reached by; repeatable")
    p.add_argument("--days", type=int, default=365, help="days the service certificates are valid (default %(default)s; "
                   f"a new CA gets at least {CA_MIN_DAYS})")
    p.add_argument("--force", action="store_true", help="replace certificates that exist (the CA is kept)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    return p


@dataclass(frozen=True, slots=True)
class Certs:
    """What `make_certs` did: the CA (new or kept) and the service certificates it wrote, by name."""

    directory: Path
    ca: x509.Certificate
    new_ca: bool
    written: dict[str, x509.Certificate]


def make_certs(directory: Path, names: Sequence[str] = DEFAULT_NAMES, hosts: Sequence[str] = (), *, days: int = 365,
               force: bool = False, keep_existing: bool = False, ca_dir: Path | None = None) -> Certs:
    """What `kvserve certs` does: a CA in `ca_dir` (default `directory`) unless one is there, and a
    certificate per name in `directory` for the name, localhost, 127.0.0.1, ::1 and `hosts`. Names that
    already have files raise TLSError, unless `force` (replaced) or `keep_existing` (left as they are:
    `kvserve up` on every start)."""
    if days < 1:
        raise TLSError(f"certificates must be valid for at least a day, not {days}")
    ca_dir = directory if ca_dir is None else ca_dir
    for d in {directory, ca_dir}:
        if d.exists() and not d.is_dir():
            raise TLSError(f"{d} is not a folder")
    ca = _load_ca(ca_dir)
    taken = [n for n in names if (directory / f"{n}.pem").exists() or (directory / f"{n}-key.pem").exists()]
    if keep_existing:
        names = [n for n in names if not ((directory / f"{n}.pem").exists() and (directory / f"{n}-key.pem").exists())]
    elif taken and not force:
        raise TLSError(f"{directory} already holds certificates for {', '.join(taken)}: pass --force to "
                       "replace them (the CA is kept), or give other --name")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    new_ca = ca is None
    if ca is None:
        ca = make_ca(max(days, CA_MIN_DAYS), now)
        _write(ca_dir / CA_KEY_FILE, _key_pem(ca[1]), 0o600)
        _write(ca_dir / CA_FILE, _cert_pem(ca[0]), 0o600)
    written = {}
    for name in names:
        cert, key = issue(name, list(dict.fromkeys([name, *LOCAL_HOSTS, *hosts])), ca[0], ca[1], days, now,
                          client=name not in SERVER_ONLY)
        _write(directory / f"{name}-key.pem", _key_pem(key), 0o600)
        _write(directory / f"{name}.pem", _cert_pem(cert), 0o600)
        written[name] = cert
    return Certs(directory, ca[0], new_ca, written)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        certs = make_certs(args.dir, list(dict.fromkeys(args.name or DEFAULT_NAMES)), args.san, days=args.days,
                           force=args.force)
    except (TLSError, OSError) as exc:
        print(f"kvserve certs: {exc}", file=sys.stderr)
        return 1
    _report(certs, args.json)
    return 0


def flags(directory: Path, name: str) -> list[str]:
    """The flags that start service `name` with its certificate from `kvserve certs DIR`."""
    return ["--tls-cert", str(directory / f"{name}.pem"), "--tls-key", str(directory / f"{name}-key.pem"),
            "--tls-ca", str(directory / CA_FILE)]


def _report(certs: Certs, as_json: bool) -> None:
    directory, ca, new_ca, written = certs.directory, certs.ca, certs.new_ca, certs.written

    def hosts(cert: x509.Certificate) -> list[str]:
        return [str(h.value) for h in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]

    if as_json:
        print(json.dumps({
            "dir": str(directory), "ca": {"cert": str(directory / CA_FILE), "key": str(directory / CA_KEY_FILE),
                                          "new": new_ca, "not_after": ca.not_valid_after_utc.isoformat()},
            "certs": {name: {"cert": str(directory / f"{name}.pem"), "key": str(directory / f"{name}-key.pem"),
                             "hosts": hosts(cert), "not_after": cert.not_valid_after_utc.isoformat(),
                             "flags": flags(directory, name)} for name, cert in written.items()},
        }, indent=2))
        return
    verb = "wrote a new CA" if new_ca else "kept the CA"
    print(f"{verb}: {directory / CA_FILE} (valid until {ca.not_valid_after_utc:%Y-%m-%d}), "
          f"key {directory / CA_KEY_FILE} (0600; whoever holds it can make certificates the services trust)")
    for name, cert in written.items():
        print(f"wrote {name}: {directory / f'{name}.pem'}, key {directory / f'{name}-key.pem'} (0600), valid until "
              f"{cert.not_valid_after_utc:%Y-%m-%d}, for {', '.join(hosts(cert))}")
    services = [name for name in written if name in DEFAULT_NAMES]
    if services:
        print("\nStart each service with its own certificate and the CA (or set "
              f"{ENV_CERT}, {ENV_KEY}, {ENV_CA}):")
        for name in services:
            print(f"  kvserve {name} {' '.join(flags(directory, name))} ...")
        print("The store and prefill then accept only callers with a certificate from this CA; the front doors "
              f"(decode or the router, and http's HTTPS) serve TLS to any caller: give clients {directory / CA_FILE} "
              "to check them.")
    tools = [name for name in written if name not in DEFAULT_NAMES]
    for name in tools:
        print(f"{directory / f'{name}.pem'} is a tool's certificate: the store accepts it like a service's, so "
              "whoever holds it (and its key) reads and writes every tenant's blocks; keep it with the operators.")


if __name__ == "__main__":
    sys.exit(main())
