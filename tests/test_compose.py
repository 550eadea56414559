"""docker-compose.yml cannot be run here (no Docker engine); check that each service's command is
one our CLI accepts and that the services point at each other."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml
from cryptography import x509

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


def _merged(base: dict, override: dict) -> dict:
    """What `docker compose -f base -f override` gives for the keys our files use: mappings merge,
    lists (volumes) add up, scalars are replaced."""
    out = dict(base)
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(name), dict):
            out[name] = _merged(base[name], value)
        elif isinstance(value, list) and isinstance(base.get(name), list):
            out[name] = [*base[name], *value]
        else:
            out[name] = value
    return out


def test_the_tls_override_starts_every_service_with_mtls(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """docker-compose.tls.yml: its one-shot `certs` command writes what the services' KVSERVE_TLS_*
    variables name, and with them each service's flags load a certificate, its key and the CA."""
    from serving.certs import main as certs_main
    from serving.cli import tls_from_args

    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    override = yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())
    services = _merged(base, override)["services"]
    assert set(services) == {*MODULES, "certs"}
    command, certs_dir, *certs_argv = services["certs"]["command"]
    assert command == "certs" and f"kvserve-certs:{certs_dir}" in services["certs"]["volumes"]
    assert certs_main([str(tmp_path), *certs_argv]) == 0  # the one-shot service, here
    assert services["kvstore"]["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
    assert services["prefill"]["depends_on"] == ["kvstore"] and services["decode"]["depends_on"] == ["prefill"]
    for name in MODULES:
        spec = services[name]
        assert f"kvserve-certs:{certs_dir}:ro" in spec["volumes"]
        for var, path in spec["environment"].items():
            assert path.startswith(f"{certs_dir}/")
            monkeypatch.setenv(var, str(tmp_path / path.removeprefix(f"{certs_dir}/")))
        _, *argv = spec["command"]
        args = importlib.import_module(MODULES[name]).parser().parse_args(argv)
        tls = tls_from_args(args, name)
        assert tls is not None and tls.has_identity and tls.ca == (tmp_path / "ca.pem").read_bytes()
        assert args.tls_cert == str(tmp_path / f"{name}.pem")  # its own certificate
        for peer in ("kvstore", "prefill"):  # the host it dials a peer by is in the peer's certificate
            if addr := getattr(args, peer, None):
                cert = x509.load_pem_x509_certificate((tmp_path / f"{peer}.pem").read_bytes())
                sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                assert addr.rsplit(":", 1)[0] in sans.get_values_for_type(x509.DNSName)
