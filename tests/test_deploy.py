"""The deployment files, checked offline (no Docker engine, no cluster here).

- The compose files, alone and merged as `docker compose -f A -f B` merges them, against the Compose
  Specification's JSON schema (the copy check-jsonschema ships as vendor.compose-spec), and their wiring:
  every setting a KVSERVE_<SERVICE>_<FLAG> variable that the service's own parser reads.
- Secure by default: the compose file's one-shot `credentials` command, run here, gives each service
  its own files and nothing else; only the front door is published, on loopback; the Kubernetes pods
  mount only their own keys of a Secret that the documented commands make; no deployment file holds
  a key or a token.
- The Kubernetes overlays, built by `kubectl kustomize`, every object against the API schemas of the
  newest Kubernetes kubernetes-validate ships, strictly (an unknown field fails), and their wiring.
- Every flag of every service readable from its variable.
- The HTTP front (http_api, OpenAI's API over HTTPS in front of the router): its own certificate and
  nothing else, published on loopback beside the router, its probes (`kvserve health URL`) run here.
- (slow) The compose file's services run as local processes, with their own commands, variables and
  health checks, form a stack that answers the admin token through the router, over TLS, and through
  the HTTP front, over HTTPS.

What needs the HTTP front's own parser (http_api.__main__.parser) skips, saying so, where it is missing.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import http.client
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
import yaml
from cryptography import x509

from kvserve.rpc.cli import env_args, env_prefix, flag_actions, flag_var, long_flag, parse_size
from tests.polling import wait_until

if TYPE_CHECKING:
    from client.local import Layout


ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
OVERRIDES = {"gpu": ROOT / "docker-compose.gpu.yml", "insecure": ROOT / "docker-compose.insecure.yml"}
COMBINATIONS = [(), ("gpu",), ("insecure",), ("gpu", "insecure")]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("trial", "production")
KUBERNETES_VERSION = "1.37"  # the newest kubernetes-validate 1.37 ships schemas for
GRPC_SERVICES = {"kvstore": "kvstore.__main__", "prefill": "prefill_service.__main__",
                 "decode": "decode_service.__main__", "router": "kvserve.router.__main__"}
SERVICES = {**GRPC_SERVICES, "http": "kvserve.http.__main__"}  # http: OpenAI's HTTP API, in front of the router
SHARED_VARS = {"KVSERVE_TLS_CERT", "KVSERVE_TLS_KEY", "KVSERVE_TLS_CA", "KVSERVE_AUTH_TOKENS", "KVSERVE_TOKEN"}
# The KVSERVE_ variables a process started here keeps: the test session's own folders (tests/conftest.py).
SESSION_VARS = {"KVSERVE_HOME", "KVSERVE_DATA_DIR"}
PORTS = {"kvstore": 50053, "prefill": 50052, "decode": 50051, "router": 50050}
HEALTH_PORTS = {name: port + 10 for name, port in PORTS.items()}  # --health-listen, on 127.0.0.1: the probes ask there
HTTP_PORT = 8000  # the HTTP front's HTTPS; it has no --health-listen: its probes GET its /health
HTTP_HEALTH = ["kvserve", "health", f"https://127.0.0.1:{HTTP_PORT}/health", "--tls-ca", "/credentials/ca.pem"]
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
# What each service reads of `kvserve credentials DIR`, and nothing else: its own certificate and key, the CA,
# and its secrets. Compose copies these into each service's own volume; each Kubernetes pod mounts these keys
# of the Secret. Neither the CA's key nor admin/ (the master keys) is in any of them.
SERVICE_FILES = {
    "kvstore": {"ca.pem": "certs/ca.pem", "kvstore.pem": "certs/kvstore.pem",
                "kvstore-key.pem": "certs/kvstore-key.pem", "record.key": "auth/record.key"},
    "prefill": {"ca.pem": "certs/ca.pem", "prefill.pem": "certs/prefill.pem",
                "prefill-key.pem": "certs/prefill-key.pem"},
    "decode": {"ca.pem": "certs/ca.pem", "decode.pem": "certs/decode.pem", "decode-key.pem": "certs/decode-key.pem",
               "tokens": "auth/tokens", "tokens.secret": "auth/tokens.secret",
               "service-tokens": "auth/service-tokens"},
    "router": {"ca.pem": "certs/ca.pem", "router.pem": "certs/router.pem", "router-key.pem": "certs/router-key.pem",
               "router.token": "auth/router.token"},
    "http": {"ca.pem": "certs/ca.pem", "http.pem": "certs/http.pem", "http-key.pem": "certs/http-key.pem"},
}


# -- the services' flags ------------------------------------------------------------------------------

def _parser_or_why(service: str) -> argparse.ArgumentParser | str:
    """The service's own parser, or why there is none yet."""
    try:
        module = importlib.import_module(SERVICES[service])
    except ModuleNotFoundError as exc:
        if exc.name is not None and SERVICES[service].startswith(exc.name):
            return f"{SERVICES[service]} does not exist yet"
        raise
    if not hasattr(module, "parser"):
        return f"{SERVICES[service]} has no parser() yet"
    return module.parser()  # type: ignore[no-any-return]


def service_parser(service: str) -> argparse.ArgumentParser:
    """The service's own parser; skips the test while the service has none (the HTTP front, until it lands)."""
    p = _parser_or_why(service)
    if isinstance(p, str):
        pytest.skip(p)
    return p


def has_parser(service: str) -> bool:
    return not isinstance(_parser_or_why(service), str)


def skip_without_parser(service: str, what: str) -> None:
    """Ends a test whose other checks passed as skipped, naming `what` it could not check yet."""
    if isinstance(why := _parser_or_why(service), str):
        pytest.skip(f"{what} not checked: {why}")


def _sample(action: argparse.Action) -> tuple[str, Any]:
    """A variable's value for the flag and what the parsed namespace must then hold (None: what the same value
    on the command line gives): never the default."""
    if action.nargs == 0:
        if isinstance(action, argparse.BooleanOptionalAction):
            return ("false", False) if action.default else ("true", True)
        return "true", action.const  # store_true, store_false, store_const
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    convert: Callable[[str], Any] = action.type if callable(action.type) else str  # type: ignore[assignment]
    for text in ("7", "2.5", "3MiB", "/tmp/kvserve-env-check", "env-check"):
        try:
            value = convert(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            continue
        if value != action.default:
            return text, None
    raise AssertionError(f"no sample value for {action.option_strings}")


@pytest.mark.parametrize("service", SERVICES)
def test_every_flag_is_readable_from_its_variable(service: str) -> None:
    """Table-driven: for each flag, its KVSERVE_<SERVICE>_<FLAG> variable alone (with the required flags'
    variables) sets it to a value other than its default."""
    p = service_parser(service)
    actions = flag_actions(p)
    required = {flag_var(service, a): _sample(a)[0] for a in actions if a.required}
    own = {"metrics_port", "health_listen"} if service in GRPC_SERVICES else {"upstream", "model_name"}
    assert {a.dest for a in actions} >= {"listen", "log_level", "tls_cert", "tls_key", "tls_ca", "insecure", *own}
    wrong = []
    for action in actions:
        text, expected = _sample(action)
        var = flag_var(service, action)
        args = p.parse_args(env_args(p, service, {**required, var: text}))
        if expected is None:  # as given on the command line, and not the default
            given = p.parse_args([*env_args(p, service, required), f"{long_flag(action)}={text}"])
            expected = getattr(given, action.dest)
            assert expected != action.default, var
        if getattr(args, action.dest) != expected:
            wrong.append(f"{var}={text!r}: {action.dest} is {getattr(args, action.dest)!r}, not {expected!r}")
    assert wrong == []


def _known_vars(service: str) -> set[str]:
    return {flag_var(service, a) for a in flag_actions(service_parser(service))}


def assert_vars_name_flags(names: set[str], where: str) -> None:
    """Every KVSERVE_* variable set by a deployment file is a flag of its service, or a shared one. The
    variables of a service without its parser yet are left unchecked, and the test skipped once the rest
    passed."""
    unknown, unchecked = set(), {}
    for name in names - SHARED_VARS:
        service = next((s for s in SERVICES if name.startswith(env_prefix(s))), None)
        if service is not None and isinstance(why := _parser_or_why(service), str):
            unchecked[name] = why
        elif service is None or name not in _known_vars(service):
            unknown.add(name)
    assert unknown == set(), f"{where}: variables no service reads (a typo?): {sorted(unknown)}"
    if unchecked:
        pytest.skip(f"{where}: {sorted(unchecked)} not checked: {', '.join(sorted(set(unchecked.values())))}")


# -- compose --------------------------------------------------------------------------------------------

COMMANDS = ("command", "entrypoint", "test")
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$\$")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """What compose makes of ${NAME:-default}, ${NAME} and $$ with `env` as the shell and .env."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1]) or (m[2] or ""), value)
    return value


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """What `docker compose -f base -f override` gives for the keys our files use: mappings merge, lists
    (volumes, ports) add up, scalars and a mapping over a scalar (build) replace, and so do the commands
    (command, entrypoint, a healthcheck's test: the Compose Specification's exceptions)."""
    out = copy.deepcopy(base)
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(name), dict):
            out[name] = merged(base[name], value)
        elif isinstance(value, list) and isinstance(base.get(name), list) and name not in COMMANDS:
            out[name] = [*base[name], *value]
        else:
            out[name] = copy.deepcopy(value)
    return out


def compose(*overrides: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    spec = yaml.safe_load(COMPOSE.read_text())
    for name in overrides:
        spec = merged(spec, yaml.safe_load(OVERRIDES[name].read_text()))
    return interpolate(spec, env or {})  # type: ignore[no-any-return]


def compose_schema() -> jsonschema.protocols.Validator:
    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)  # type: ignore[no-any-return]


def schema_errors(validator: jsonschema.protocols.Validator, spec: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(spec)]


@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "+".join(o) or "base")
def test_the_compose_files_follow_the_compose_specification(overrides: tuple[str, ...]) -> None:
    validator = compose_schema()
    for path in [COMPOSE, *(OVERRIDES[o] for o in overrides)]:
        assert schema_errors(validator, yaml.safe_load(path.read_text())) == [], path.name
    spec = compose(*overrides)
    assert schema_errors(validator, spec) == []
    assert "${" not in json.dumps(spec)  # every variable has its default
    typo = copy.deepcopy(spec)
    typo["services"]["decode"]["enviroment"] = typo["services"]["decode"].pop("environment")
    assert schema_errors(validator, typo) != []  # the schema does check the services' keys


def service_args(service: str, spec: dict[str, Any]) -> argparse.Namespace:
    """The flags the compose service's command and variables give its process."""
    p = service_parser(service)
    assert spec["command"] == [service]  # the image's entrypoint is `kvserve`
    env = {k: str(v) for k, v in spec.get("environment", {}).items()}
    return p.parse_args(env_args(p, service, env))


def test_the_compose_services_are_wired_through_their_variables() -> None:
    services = compose()["services"]
    assert set(services) == {"credentials", "model-init", "redis", *SERVICES}
    args = {name: service_args(name, services[name]) for name in GRPC_SERVICES}
    for name, port in PORTS.items():
        spec = services[name]
        assert args[name].listen == f"0.0.0.0:{port}"
        assert args[name].health_listen == f"127.0.0.1:{HEALTH_PORTS[name]}"
        assert spec["healthcheck"]["test"] == ["CMD", "kvserve", "health", args[name].health_listen]
        assert all(k.startswith(env_prefix(name)) or k in SHARED_VARS for k in spec["environment"])  # no strays
        assert not args[name].insecure  # TLS unless docker-compose.insecure.yml says otherwise
        assert spec["depends_on"]["credentials"] == {"condition": "service_completed_successfully"}
        for dep, condition in spec["depends_on"].items():
            if services[dep].get("restart") == "no":  # a one-shot: credentials, model-init
                assert condition == {"condition": "service_completed_successfully"}
            else:
                assert condition == {"condition": "service_healthy"} and "healthcheck" in services[dep]
    assert args["prefill"].kvstore == args["decode"].kvstore == "kvstore:50053"
    assert args["decode"].prefill == "prefill:50052" and args["router"].decode == "decode:50051"
    assert args["prefill"].model == args["decode"].model == "/models/tiny-llama"
    assert args["prefill"].threads == args["decode"].threads == 1  # shares of one host's cores (2 by default)
    # Same-host shared memory needs one IPC namespace for the store and its clients.
    assert services["kvstore"]["ipc"] == "shareable"
    assert services["prefill"]["ipc"] == services["decode"]["ipc"] == "service:kvstore"
    assert "models:/models:ro" in services["prefill"]["volumes"] and "models:/models:ro" in services["decode"]["volumes"]
    assert args["kvstore"].disk_path == Path("/data/kvstore") and "kvstore-data:/data" in services["kvstore"]["volumes"]
    init = services["model-init"]
    assert init["volumes"] == ["models:/models"] and init["entrypoint"] == ["sh", "-c"]
    assert "test -f /models/tiny-llama/config.json ||" in init["command"][0]
    assert "kvserve model init" in init["command"][0]
    redis = services["redis"]["command"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in redis
    assert redis[redis.index("--save") + 1] == "" and redis[redis.index("--appendonly") + 1] == "no"
    assert args["kvstore"].remote_url == "redis://redis:6379/0"


def test_compose_settings_come_from_the_environment_or_env_file() -> None:
    """An operator changes a setting with a variable (or .env) and nothing else."""
    services = compose(env={"KVSERVE_KVSTORE_HOST_CAPACITY": "8GiB", "KVSERVE_MODEL": "/models/mine",
                            "KVSERVE_DECODE_MAX_NUM_SEQS": "128"})["services"]
    args = {name: service_args(name, services[name]) for name in ("kvstore", "prefill", "decode")}
    assert args["kvstore"].host_capacity == parse_size("8GiB")
    assert args["prefill"].model == args["decode"].model == "/models/mine"
    assert args["decode"].max_num_seqs == 128
    assert args["decode"].kv_cache_memory is None  # an empty variable leaves the default


def test_the_http_front_is_wired_to_the_router() -> None:
    """The HTTP front: the image's `kvserve http`, HTTPS with its own certificate on 0.0.0.0:8000, the router
    (by a name its certificate holds) as its upstream, the model's name beside the model folder's, and a
    health check that GETs its /health over HTTPS. It holds no model: no models volume, no store IPC."""
    services = compose()["services"]
    spec, router = services["http"], services["router"]
    env = spec["environment"]
    assert spec["command"] == ["http"] and "entrypoint" not in spec
    assert all(k.startswith(env_prefix("http")) for k in env)  # its TLS variables are its own: no KVSERVE_TLS_*
    assert (env["KVSERVE_HTTP_TLS_CERT"], env["KVSERVE_HTTP_TLS_KEY"], env["KVSERVE_HTTP_TLS_CA"]) == (
        "/credentials/http.pem", "/credentials/http-key.pem", "/credentials/ca.pem")
    assert env["KVSERVE_HTTP_LISTEN"] == f"0.0.0.0:{HTTP_PORT}"
    assert env["KVSERVE_HTTP_UPSTREAM"] == f"router:{PORTS['router']}"
    assert router["environment"]["KVSERVE_ROUTER_LISTEN"] == f"0.0.0.0:{PORTS['router']}"
    assert env["KVSERVE_HTTP_MODEL_NAME"] == Path(services["decode"]["environment"]["KVSERVE_DECODE_MODEL"]).name
    assert spec["healthcheck"]["test"] == ["CMD", *HTTP_HEALTH]
    assert spec["depends_on"] == {"credentials": {"condition": "service_completed_successfully"},
                                  "router": {"condition": "service_healthy"}}
    assert spec["volumes"] == ["http-credentials:/credentials:ro"] and "ipc" not in spec
    mine = compose(env={"KVSERVE_MODEL": "/models/mine", "KVSERVE_MODEL_NAME": "mine"})["services"]
    assert mine["http"]["environment"]["KVSERVE_HTTP_MODEL_NAME"] == "mine"

    args = service_args("http", spec)  # what its own parser makes of them (skips until http_api lands)
    assert (args.listen, args.upstream, args.model_name) == (f"0.0.0.0:{HTTP_PORT}", "router:50050", "tiny-llama")
    assert not args.insecure and args.tls_cert == "/credentials/http.pem"


def test_compose_variables_name_real_flags() -> None:
    for overrides in COMBINATIONS:
        names = {k for spec in compose(*overrides)["services"].values() for k in spec.get("environment", {})}
        assert_vars_name_flags(names, f"compose {overrides}")


def test_the_gpu_override_reserves_gpus_and_selects_cuda() -> None:
    services = compose("gpu")["services"]
    for name in ("kvstore", "prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert service_args(name, services[name]).device == "cuda"
    assert "deploy" not in services["router"] and "deploy" not in services["http"]  # no model, no GPU
    images = {spec.get("image") for spec in services.values() if "build" in spec}
    assert len(images) == 1  # one image, built once, with torch's CUDA build
    assert all(spec["build"]["args"]["TORCH_INDEX"] == "" for spec in services.values() if "build" in spec)
    assert re.search(r"^ARG TORCH_INDEX=", (ROOT / "Dockerfile").read_text(), re.MULTILINE)


def published(services: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """Each service's published ports as (host address, host port); address '' is every interface."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, spec in services.items():
        for port in spec.get("ports", []):
            if isinstance(port, dict):  # the long syntax
                out.setdefault(name, []).append((port.get("host_ip", ""), str(port.get("published", ""))))
                continue
            parts = str(port).rsplit(":", 2)  # [HOST_IP:][HOST_PORT:]CONTAINER_PORT
            out.setdefault(name, []).append((parts[0] if len(parts) == 3 else "", parts[-2] if len(parts) > 1 else ""))
    return out


@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "+".join(o) or "base")
def test_only_the_front_doors_are_published_and_on_loopback(overrides: tuple[str, ...]) -> None:
    """Not the store's port, not prefill's or decode's, not the metrics ports, not Valkey's; the router's and
    the HTTP front's on 127.0.0.1 unless KVSERVE_PUBLISH_HOST says otherwise, on ports KVSERVE_GRPC_PORT and
    KVSERVE_HTTP_PORT say (a host where today's are taken)."""
    services = compose(*overrides)["services"]
    assert published(services) == {"router": [("127.0.0.1", "50050")], "http": [("127.0.0.1", "8000")]}
    wide = compose(*overrides, env={"KVSERVE_PUBLISH_HOST": "0.0.0.0", "KVSERVE_GRPC_PORT": "40050",
                                    "KVSERVE_HTTP_PORT": "8443"})["services"]
    assert published(wide) == {"router": [("0.0.0.0", "40050")], "http": [("0.0.0.0", "8443")]}
    assert services["http"]["ports"] == [f"127.0.0.1:8000:{HTTP_PORT}"]  # to the port it listens on
    services["decode"]["ports"] = ["50051:50051", {"target": 9100, "published": 9100}]  # the check can fail
    assert published(services)["decode"] == [("", "50051"), ("", "9100")]


def service_args_in(stack: LocalCompose, name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The flags the service's variables give it as `stack` runs it (its volumes mapped to folders), the shared
    KVSERVE_TLS_* included."""
    env = stack.env(name)
    for var in SHARED_VARS:
        if env.get(var):
            monkeypatch.setenv(var, env[var])
        else:
            monkeypatch.delenv(var, raising=False)
    p = service_parser(name)  # reads the shared variables as its defaults
    return p.parse_args(env_args(p, name, env))


# The flag by which a service dials a peer, and the peer.
PEERS = {"kvstore": "kvstore", "prefill": "prefill", "decode": "decode", "upstream": "router"}


def cert_hosts(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))]


def exported_files() -> list[str]:
    """The files the compose file's header tells a user to take out of the credentials volume."""
    return re.findall(r"docker compose run --rm -T --entrypoint cat credentials (\S+) >", COMPOSE.read_text())


def test_the_credentials_job_gives_each_service_its_own_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-shot `credentials` command, run as compose runs it (volumes mapped to folders), makes the node's
    credentials in the `credentials` volume, which no running service mounts, and copies each service only the
    files it reads into a volume of its own that only it mounts, read-only. With them each service serves TLS
    with its own certificate, named for every host it is dialled by, and has its secrets. A volume made before
    the HTTP front existed gains its certificate on the next run, and nothing else changes."""
    from client.local import Layout
    from kvserve.router.__main__ import service_token
    from kvserve.rpc.auth import auth_from_args

    spec = compose()
    stack = LocalCompose(spec, tmp_path)
    stack.run_once("credentials")
    master = Layout(stack.volumes["credentials"])
    assert master.complete() and (master.certs / "ca-key.pem").is_file()
    assert [f.removeprefix("/credentials/") for f in exported_files()] == ["certs/ca.pem", "admin/admin.token"]

    assert mounted_by(spec["services"], "credentials") == ["credentials"]  # the master keys and the CA's key
    for name, names in SERVICE_FILES.items():
        _check_own_files(stack, master, name, names, monkeypatch)

    store = service_args_in(stack, "kvstore", monkeypatch)
    assert store.record_key_file == stack.volumes["kvstore-credentials"] / "record.key" and store.remote_url
    auth = auth_from_args(service_args_in(stack, "decode", monkeypatch), "decode")
    assert auth is not None and auth.authenticator is not None and auth.services is not None
    admin = master.admin_token.read_text().strip()
    router = service_token(service_args_in(stack, "router", monkeypatch))
    assert (auth.authenticator.tenant_of(admin), auth.services.tenant_of(router)) == ("admin", "router")
    assert auth.authenticator.tenant_of(router) is None and auth.services.tenant_of(admin) is None

    _check_a_second_run_keeps_them(stack, master)
    skip_without_parser("http", "the HTTP front's TLS from its variables")


def mounted_by(services: dict[str, Any], volume: str) -> list[str]:
    return [n for n, s in services.items() if any(m.split(":")[0] == volume for m in s.get("volumes", []))]


def _check_own_files(stack: LocalCompose, master: Layout, name: str, names: dict[str, str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`name` alone mounts its volume, read-only, holding copies of `names` (secrets 0600), which its variables
    name; it serves TLS with its certificate, named for each host its peers dial it by."""
    from kvserve.rpc.cli import tls_from_args

    services = stack.services
    own = stack.volumes[f"{name}-credentials"]
    assert mounted_by(services, f"{name}-credentials") == ["credentials", name]
    assert f"{name}-credentials:/credentials:ro" in services[name]["volumes"]
    assert sorted(f.name for f in own.iterdir()) == sorted(names)
    for file, source in names.items():
        assert (own / file).read_bytes() == (master.root / source).read_bytes()
        if not file.endswith(".pem") or file.endswith("-key.pem"):
            assert (own / file).stat().st_mode & 0o077 == 0, file  # secrets stay 0600
    env = stack.env(name)  # its variables name every file it gets, and only those
    assert {Path(env[k]) for k, v in services[name]["environment"].items()
            if str(v).startswith("/credentials/")} == {own / f for f in names}
    assert "127.0.0.1" in cert_hosts(own / f"{name}.pem")  # what its health check dials
    if not has_parser(name):
        return  # the HTTP front until http_api lands: skipped at the end
    args = service_args_in(stack, name, monkeypatch)
    tls = tls_from_args(args, name)
    assert tls is not None and tls.has_identity and tls.ca == master.ca.read_bytes()
    assert args.tls_cert == str(own / f"{name}.pem")
    dialled = service_args(name, services[name])
    for flag, peer in PEERS.items():  # the host it dials a peer by is in the peer's certificate
        if (addr := getattr(dialled, flag, None)) and name != peer:
            assert addr.rsplit(":", 1)[0] in cert_hosts(stack.volumes[f"{peer}-credentials"] / f"{peer}.pem")


def _check_a_second_run_keeps_them(stack: LocalCompose, master: Layout) -> None:
    """The job run again keeps what is there; run on a volume made before the HTTP front, it adds its
    certificate, from the same CA, and changes nothing else."""
    before = {f: f.read_bytes() for f in master.root.rglob("*") if f.is_file()}
    stack.run_once("credentials")  # every `up` runs it again: it keeps what is there
    assert {f: f.read_bytes() for f in master.root.rglob("*") if f.is_file()} == before

    http_files = master.cert("http")  # as a volume made before the HTTP front was
    for f in http_files:
        f.unlink()
    stack.run_once("credentials")
    after = {f: f.read_bytes() for f in master.root.rglob("*") if f.is_file()}
    assert {f: b for f, b in after.items() if f not in http_files} == {
        f: b for f, b in before.items() if f not in http_files}  # the CA, the other certificates, the secrets
    assert set(after) == set(before) and after[http_files[0]] != before[http_files[0]]
    x509.load_pem_x509_certificate(after[http_files[0]]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(after[master.ca]))
    assert (stack.volumes["http-credentials"] / "http.pem").read_bytes() == after[http_files[0]]


def test_the_insecure_override_serves_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    """docker-compose.insecure.yml: each service takes --insecure and no TLS variable (an empty variable is
    none), so its health check asks in plaintext too; decode's tokens and the store's record key stay."""
    from kvserve.cli.health import parser as health_parser
    from kvserve.rpc.cli import tls_from_args

    services = compose("insecure")["services"]
    for name in GRPC_SERVICES:
        env = services[name]["environment"]
        for var in ("KVSERVE_TLS_CERT", "KVSERVE_TLS_KEY", "KVSERVE_TLS_CA"):
            assert env[var] == ""
            monkeypatch.setenv(var, env[var])
        args = service_args(name, services[name])
        assert args.insecure and tls_from_args(args, name) is None
        health = health_parser().parse_args(["127.0.0.1:1"])
        assert health.tls_ca is None and health.tls_cert is None and health.tls_key is None
    assert service_args("decode", services["decode"]).auth_tokens == Path("/credentials/tokens")
    assert service_args("kvstore", services["kvstore"]).record_key_file == Path("/credentials/record.key")
    # The HTTP front: plain HTTP, plaintext to the router; its health check asks http:// (the override's test
    # replaces the file's, as compose merges a healthcheck's test).
    http = services["http"]
    assert {k: v for k, v in http["environment"].items() if "_TLS_" in k or k.endswith("_INSECURE")} == {
        "KVSERVE_HTTP_TLS_CERT": "", "KVSERVE_HTTP_TLS_KEY": "", "KVSERVE_HTTP_TLS_CA": "",
        "KVSERVE_HTTP_INSECURE": "true"}
    assert http["healthcheck"]["test"] == ["CMD", "kvserve", "health", f"http://127.0.0.1:{HTTP_PORT}/health"]
    args = service_args("http", http)  # skips until http_api lands
    assert args.insecure and tls_from_args(args, "http") is None


def test_the_image_makes_the_folders_the_credentials_job_writes_into() -> None:
    """A new named volume takes the owner of the image's folder it is mounted on: each folder the job copies
    into must be in the image, the image's user's, or the job (that user) cannot write there."""
    job = compose()["services"]["credentials"]
    targets = {m.split(":")[1] for m in job["volumes"]}
    assert targets >= {f"/export/{name}" for name in SERVICE_FILES}
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    made = set(re.search(r"mkdir -p ([^&]+)", dockerfile)[1].split())  # type: ignore[index]
    owned = re.search(r"chown -R kvserve:kvserve ([^&\n]+)", dockerfile)[1].split()  # type: ignore[index]
    assert targets <= made and all(any(t == o or t.startswith(o + "/") for o in owned) for t in targets)


# -- no key or token in the repository ------------------------------------------------------------------

DEPLOY_FILES = sorted([ROOT / "Dockerfile", *ROOT.glob("docker-compose*.yml"),
                       *(f for f in KUSTOMIZE.rglob("*") if f.is_file())])
_PEM = re.compile(r"-----BEGIN [A-Z ]+-----|PRIVATE KEY")
_HEX = re.compile(r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{32,}(?![0-9A-Fa-f])")  # secrets, record keys, token hashes
_WORD = re.compile(r"(?<![\w-])[\w-]{32,}(?![\w-])")  # a bearer token: token_urlsafe's 43 characters


def secrets_in(text: str) -> list[str]:
    """What in `text` looks like a key, a certificate, a secret or a token."""
    tokens = [w for w in _WORD.findall(text)
              if re.search(r"[a-z]", w) and re.search(r"[A-Z]", w) and re.search(r"\d", w)]
    return [*_PEM.findall(text), *_HEX.findall(text), *tokens]


def test_no_deployment_file_holds_a_key_or_token(tmp_path: Path) -> None:
    """The compose files, the Dockerfile and the Kubernetes files hold no key, certificate, token or secret,
    and make none: no Secret object, no secretGenerator (the pods' Secret is the operator's)."""
    from kvserve.stack.credentials import ensure

    assert ROOT / "docker-compose.yml" in DEPLOY_FILES and KUSTOMIZE / "base" / "kvstore.yaml" in DEPLOY_FILES
    assert {str(f.relative_to(ROOT)): found for f in DEPLOY_FILES if (found := secrets_in(f.read_text()))} == {}
    for f in KUSTOMIZE.rglob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc is None or (doc.get("kind") != "Secret" and "secretGenerator" not in doc), f
    layout, _ = ensure(tmp_path)  # the check can fail: it finds every file `kvserve credentials` makes
    made = [f for f in layout.root.rglob("*") if f.is_file()]
    assert len(made) >= 16 and [f.name for f in made if not secrets_in(f.read_text())] == []
    assert secrets_in(f"KVSERVE_TOKEN={layout.admin_token.read_text()}")


# -- Kubernetes -----------------------------------------------------------------------------------------

KUBECTL = shutil.which("kubectl")


def kustomize(overlay: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def k8s_errors(obj: dict[str, Any]) -> str | None:
    from kubernetes_validate import utils

    try:
        utils.validate(obj, KUBERNETES_VERSION, strict=True)
    except utils.ValidationError as exc:
        return f"{obj['kind']}/{obj['metadata']['name']}: {exc}"
    return None


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def pod_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """An overlay's name and the objects `kubectl kustomize` builds from it."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (its kustomize builds the overlays); Debian's kubernetes-client "
                    "is too old for them, so `make setup` does not install it")
    return request.param, kustomize(request.param)


def config_map(objects: list[dict[str, Any]]) -> dict[str, str]:
    return next(o for o in objects if o["kind"] == "ConfigMap"  # type: ignore[no-any-return]
                and o["metadata"]["name"].startswith("kvserve-config"))["data"]


def test_the_kubernetes_overlay_builds_and_validates(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    assert [e for e in map(k8s_errors, objects) if e] == []
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] != "Namespace"} == {"kvserve"}
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "Job")]
    for obj in workloads:
        for c in pod_containers(obj):
            where = f"{obj['metadata']['name']}/{c['name']}"
            for kind in ("requests", "limits"):  # requests and limits everywhere
                assert {"cpu", "memory"} <= set(c["resources"][kind]), where
            for ref in c.get("envFrom", []):  # the generated name, hash and all
                assert ref["configMapRef"]["name"] == config["metadata"]["name"], where
    assert_vars_name_flags(set(config_map(objects)), f"{name} ConfigMap")


KINDS = {"kvstore": "DaemonSet", "prefill": "Deployment", "decode": "Deployment", "router": "Deployment"}


def test_each_kubernetes_service_serves_and_is_probed_on_its_port(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    config = config_map(objects)
    assert not any(k.endswith("_INSECURE") for k in config)  # TLS everywhere
    for service, kind in KINDS.items():
        template = find(objects, kind, f"kvserve-{service}")["spec"]["template"]
        container = template["spec"]["containers"][0]
        assert container["args"] == [service]  # the image's entrypoint is `kvserve`
        assert {"configMapRef": {"name": next(o for o in objects if o["kind"] == "ConfigMap")["metadata"]["name"]}} \
            in container["envFrom"]
        assert config[f"{env_prefix(service)}LISTEN"] == f"0.0.0.0:{PORTS[service]}"
        health = config[f"{env_prefix(service)}HEALTH_LISTEN"]
        assert health == f"127.0.0.1:{HEALTH_PORTS[service]}"
        # `kvserve health`, which presents the pod's own certificate (KVSERVE_TLS_*): the native gRPC probe
        # speaks plaintext only. It takes about a second to start.
        probes = [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
        assert {"readinessProbe", "livenessProbe"} <= set(probes)
        for probe in probes:
            assert container[probe]["exec"] == {"command": ["kvserve", "health", health]}
            assert container[probe]["timeoutSeconds"] >= 5
        assert all("hostPort" not in p for p in container["ports"])  # reached through Services only
        assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
        assert_vars_name_flags({e["name"] for e in container.get("env", []) if e["name"].startswith("KVSERVE_")},
                               f"{name} kvserve-{service}")


def test_each_pod_mounts_only_its_own_keys_of_the_secret(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """The Secret kvserve-credentials (the operator's: no overlay makes one) mounted read-only at /credentials,
    only the pod's own keys, readable by the pod's group; the pod's variables name each of them."""
    _, objects = overlay
    assert [o for o in objects if o["kind"] == "Secret"] == []
    for service, kind in {**KINDS, "http": "Deployment"}.items():
        pod = find(objects, kind, f"kvserve-{service}")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        volume = next(v for v in pod["volumes"] if v["name"] == "credentials")["secret"]
        assert volume["secretName"] == "kvserve-credentials" and volume["defaultMode"] == 0o440
        assert {i["key"]: i["path"] for i in volume["items"]} == {f: f for f in SERVICE_FILES[service]}
        assert {"name": "credentials", "mountPath": "/credentials", "readOnly": True} in container["volumeMounts"]
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        tls = "KVSERVE_TLS_" if service in GRPC_SERVICES else f"{env_prefix(service)}TLS_"  # the HTTP front's own
        assert (env[f"{tls}CERT"], env[f"{tls}KEY"], env[f"{tls}CA"]) == (
            f"/credentials/{service}.pem", f"/credentials/{service}-key.pem", "/credentials/ca.pem")
        assert {v for v in env.values() if v and v.startswith("/credentials/")} == {
            f"/credentials/{f}" for f in SERVICE_FILES[service]}
        for init in pod.get("initContainers", []):  # the model's builder needs none of it
            assert all(m["name"] != "credentials" for m in init.get("volumeMounts", []))


def documented_secret_commands() -> str:
    """The block of docs/OPERATIONS.md that makes the credentials and the Secret."""
    blocks = re.findall(r"```sh\n(.*?)```", OPERATIONS.read_text(), re.DOTALL)
    return next(b for b in blocks if "create secret generic kvserve-credentials" in b)


@pytest.fixture(scope="module")
def documented_secret(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The Secret that docs/OPERATIONS.md's commands make, run here (HOME a temporary folder, kubectl as
    `--dry-run=client -o yaml`): its keys and their bytes."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    home = tmp_path_factory.mktemp("home")
    out = home / "objects.yaml"
    script = (f'set -e\nkvserve() {{ "{sys.executable}" -m kvserve.cli "$@"; }}\n'
              f'kubectl() {{ "{KUBECTL}" "$@" --dry-run=client -o yaml >> "{out}"; echo --- >> "{out}"; }}\n'
              + documented_secret_commands())
    done = subprocess.run(["bash", "-c", script], cwd=home, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    secrets = [o for o in yaml.safe_load_all(out.read_text()) if o and o["kind"] == "Secret"]
    assert [(s["metadata"]["name"], s["metadata"]["namespace"]) for s in secrets] == [("kvserve-credentials", "kvserve")]
    return {key: base64.b64decode(value) for key, value in secrets[0]["data"].items()}


def test_the_documented_secret_holds_what_the_pods_mount_and_no_master_key(
        overlay: tuple[str, list[dict[str, Any]]], documented_secret: dict[str, bytes], tmp_path: Path) -> None:
    """Every key a pod mounts and nothing more: not the CA's key, not admin/. Each service's certificate names
    every host it is dialled by in the overlay (its Service), the front door's names `kvserve` and the HTTP
    front's `kvserve-http`."""
    _, objects = overlay
    assert set(documented_secret) == {f for files in SERVICE_FILES.values() for f in files}
    for name, data in documented_secret.items():
        (tmp_path / name).write_bytes(data)
    config = config_map(objects)
    dialled = {"kvstore": [config["KVSERVE_PREFILL_KVSTORE"], config["KVSERVE_DECODE_KVSTORE"]],
               "prefill": [config["KVSERVE_DECODE_PREFILL"]], "decode": [config["KVSERVE_ROUTER_DECODE"]],
               "router": ["kvserve:50050", config["KVSERVE_HTTP_UPSTREAM"]], "http": [f"kvserve-http:{HTTP_PORT}"]}
    for service, addrs in dialled.items():
        for addr in addrs:
            host = addr.rsplit(":", 1)[0]
            assert host in cert_hosts(tmp_path / f"{service}.pem"), (service, host)
            assert any(o["kind"] == "Service" and o["metadata"]["name"] == host for o in objects)


def test_prefill_and_decode_pods_share_their_nodes_store(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Each prefill and decode pod calls its own node's store (a Service of internalTrafficPolicy Local), maps
    its arena through the same /dev/shm as the same user, and reads the model volume; decode calls the
    prefill pods of its own node, and is scheduled only beside one."""
    _, objects = overlay
    config = config_map(objects)
    store = find(objects, "DaemonSet", "kvserve-kvstore")["spec"]["template"]["spec"]
    shm = next(v for v in store["volumes"] if v["name"] == "shm")
    for service in ("prefill", "decode"):
        pod = find(objects, "Deployment", f"kvserve-{service}")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        host, port = config[f"{env_prefix(service)}KVSTORE"].split(":")
        local = find(objects, "Service", host)["spec"]
        assert local["internalTrafficPolicy"] == "Local" and local["ports"][0]["port"] == int(port) == PORTS["kvstore"]
        assert local["selector"]["app.kubernetes.io/component"] == "kvstore"
        assert next(v for v in pod["volumes"] if v["name"] == "shm") == shm
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert pod["securityContext"]["runAsUser"] == store["securityContext"]["runAsUser"]  # the arena's check
        assert f"USER {pod['securityContext']['runAsUser']}\n" in (ROOT / "Dockerfile").read_text()  # the image's
        assert config[f"{env_prefix(service)}MODEL"].startswith("/models/")
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        init = pod["initContainers"][0]["command"][-1]
        assert "test -f /models/tiny-llama/config.json" in init and "kvserve model init" in init
    host, port = config["KVSERVE_DECODE_PREFILL"].split(":")
    local = find(objects, "Service", host)["spec"]
    assert local["internalTrafficPolicy"] == "Local" and local["ports"][0]["port"] == int(port) == PORTS["prefill"]
    assert local["selector"]["app.kubernetes.io/component"] == "prefill"
    affinity = find(objects, "Deployment", "kvserve-decode")["spec"]["template"]["spec"]["affinity"]
    assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {
            "app.kubernetes.io/name": "kvserve", "app.kubernetes.io/component": "prefill"}}}]


def test_the_router_fronts_every_decode_replica(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    host, port = config_map(objects)["KVSERVE_ROUTER_DECODE"].split(":")
    replicas = find(objects, "Service", host)["spec"]  # headless: one address per ready decode pod
    assert replicas["clusterIP"] == "None" and replicas["ports"][0]["port"] == int(port) == PORTS["decode"]
    assert replicas["selector"]["app.kubernetes.io/component"] == "decode"
    front = find(objects, "Service", "kvserve")["spec"]
    assert front["selector"]["app.kubernetes.io/component"] == "router"
    assert front["ports"][0]["port"] == PORTS["router"]


def http_probes(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    container = find(objects, "Deployment", "kvserve-http")["spec"]["template"]["spec"]["containers"][0]
    return {p: container[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
            if p in container}


def test_the_http_front_serves_https_in_front_of_the_router(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Deployment and Service kvserve-http: `kvserve http` on :8000 with its certificate from the Secret (the
    mounts: test_each_pod_mounts_only_its_own_keys_of_the_secret), the router's Service as its upstream, the
    model's name beside the model folder, probes that GET its /health over HTTPS against the CA, small
    resources and no GPU, model or store: it holds no model."""
    name, objects = overlay
    config = config_map(objects)
    template = find(objects, "Deployment", "kvserve-http")["spec"]["template"]
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert container["args"] == ["http"]
    assert {"configMapRef": {"name": next(o for o in objects if o["kind"] == "ConfigMap")["metadata"]["name"]}} \
        in container["envFrom"]
    assert config["KVSERVE_HTTP_LISTEN"] == f"0.0.0.0:{HTTP_PORT}"
    assert config["KVSERVE_HTTP_MODEL_NAME"] == Path(config["KVSERVE_DECODE_MODEL"]).name
    host, port = config["KVSERVE_HTTP_UPSTREAM"].rsplit(":", 1)
    upstream = find(objects, "Service", host)["spec"]
    assert upstream["selector"]["app.kubernetes.io/component"] == "router" and upstream.get("clusterIP") != "None"
    assert upstream["ports"][0]["port"] == int(port) == PORTS["router"]
    service = find(objects, "Service", "kvserve-http")["spec"]
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    assert service["selector"]["app.kubernetes.io/component"] == "http"
    assert service["ports"] == [{"name": "https", "port": HTTP_PORT, "targetPort": "https"}]
    assert container["ports"] == [{"name": "https", "containerPort": HTTP_PORT},  # no hostPort
                                  {"name": "metrics", "containerPort": 9104}]
    assert config["KVSERVE_HTTP_METRICS_PORT"] == "9104"  # metrics on their own port, not the public one
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9104"
    assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"

    probes = http_probes(objects)
    assert probes["readinessProbe"] == HTTP_HEALTH  # ready while the router serves
    assert probes["livenessProbe"] == ["sh", "-c", f"{' '.join(HTTP_HEALTH)}; test $? -le 1"]  # while it answers
    assert all(container[p]["timeoutSeconds"] >= 5 for p in probes)

    assert "nvidia.com/gpu" not in container["resources"]["limits"] and "tolerations" not in pod
    assert parse_size(container["resources"]["limits"]["memory"].replace("i", "iB")) <= 1 << 30
    assert {v["name"] for v in pod["volumes"]} == {"credentials"} and "initContainers" not in pod
    assert_vars_name_flags({e["name"] for e in container["env"]}, f"{name} kvserve-http")


def test_the_http_fronts_probes_ask_its_health(tmp_path: Path) -> None:
    """The probes' commands, run here against a stdlib HTTPS server with the HTTP front's certificate and the
    CA from `kvserve credentials`: readiness passes on 200 only; liveness on any answer (a 503 says the
    router is down, which restarting the pod would not mend), not when nothing answers."""
    from kvserve.stack.credentials import ensure
    from tests.http_fixtures import http_server

    layout, _ = ensure(tmp_path / "credentials")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(*layout.cert("http"))
    base = yaml.safe_load_all((KUSTOMIZE / "base" / "http.yaml").read_text())
    probes = http_probes([o for o in base if o])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k in SESSION_VARS}
    kvserve = f"{shlex.quote(sys.executable)} -m kvserve.cli"

    def passes(probe: str, port: int, path: str) -> bool:
        command = [kvserve if a == "kvserve" else a for a in probes[probe]]
        if command[0] == "sh":  # the shell's own command line
            command = [*command[:2], command[2].replace("kvserve health", f"{kvserve} health")]
        else:
            command = ["sh", "-c", " ".join(command)]
        command[2] = (command[2].replace(f"https://127.0.0.1:{HTTP_PORT}/health", f"https://127.0.0.1:{port}{path}")
                      .replace("/credentials/ca.pem", str(layout.ca)))
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=60).returncode == 0

    with http_server(tls) as port:
        assert passes("readinessProbe", port, "/health") and passes("livenessProbe", port, "/health")
        assert not passes("readinessProbe", port, "/down") and passes("livenessProbe", port, "/down")
    assert not passes("readinessProbe", port, "/health") and not passes("livenessProbe", port, "/health")


def test_the_overlays_remote_tier_replicas_and_devices(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    config = config_map(objects)
    remote = config["KVSERVE_KVSTORE_REMOTE_URL"]
    if name == "trial":  # its own Valkey, an LRU cache without persistence
        args = find(objects, "Deployment", "kvserve-redis")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in args
        assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
        port = find(objects, "Service", "kvserve-redis")["spec"]["ports"][0]["port"]
        assert remote == f"redis://kvserve-redis:{port}/0"
    else:  # an external Redis, more replicas, a GPU per prefill and decode pod
        assert remote.startswith("redis") and not any(o["kind"] == "Service" and o["metadata"]["name"] in remote
                                                      for o in objects)
        for deployment in ("kvserve-prefill", "kvserve-decode", "kvserve-router", "kvserve-http"):
            assert find(objects, "Deployment", deployment)["spec"]["replicas"] > 1
        for deployment in ("kvserve-prefill", "kvserve-decode"):
            container = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert config["KVSERVE_PREFILL_DEVICE"] == config["KVSERVE_DECODE_DEVICE"] == "cuda"


def test_the_kubernetes_schema_check_can_fail() -> None:
    """Strict validation: a misspelt field, which a cluster would silently drop, is an error."""
    deployment = next(yaml.safe_load_all((KUSTOMIZE / "base" / "router.yaml").read_text()))
    assert k8s_errors(deployment) is None
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {"grpc": {"port": 50050}}
    assert k8s_errors(deployment) is not None


def test_the_kubernetes_settings_name_real_flags() -> None:
    """Without kubectl too: the base's and the overlays' settings files."""
    for path in KUSTOMIZE.rglob("*.env"):
        names = {line.split("=", 1)[0] for line in path.read_text().splitlines() if line and not line.startswith("#")}
        assert names and all(n.startswith("KVSERVE_") for n in names), path
        assert_vars_name_flags(names, str(path.relative_to(ROOT)))


# -- the compose stack as local processes ----------------------------------------------------------------

class LocalCompose:
    """Runs compose services as local processes: each service's `command` (the image's entrypoint is
    `kvserve`) with its `environment`, host names rewritten to 127.0.0.1, ports to free ones and volume
    paths to folders under `tmp`."""

    def __init__(self, spec: dict[str, Any], tmp: Path) -> None:
        from tests.processes import free_ports

        self.services = spec["services"]
        self.tmp = tmp
        self.volumes = {name: tmp / "volumes" / name for name in spec["volumes"]}
        for d in self.volumes.values():
            d.mkdir(parents=True)
        (tmp / "logs").mkdir()
        self._free_ports = free_ports
        self.ports: dict[tuple[str, int], int] = {}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        names = "|".join(re.escape(n) for n in self.services)
        self._addr = re.compile(rf"(?<![\w.-])(0\.0\.0\.0|127\.0\.0\.1|{names}):(\d+)")

    def port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            self.ports[service, port] = self._free_ports(1)[0]
        return self.ports[service, port]

    def rewrite(self, service: str, key: str, value: str) -> str:
        if key.endswith("_METRICS_PORT"):
            return str(self.port(service, int(value)))
        value = self._addr.sub(lambda m: f"127.0.0.1:{self.port(service if m[1][0].isdigit() else m[1], int(m[2]))}",
                               value)
        for mount in self.services[service].get("volumes", []):
            volume, target = mount.split(":")[:2]
            value = value.replace(target, str(self.volumes[volume]))
        return value

    def env(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k in SESSION_VARS}
        env.update(PYTHONUNBUFFERED="1", KVSERVE_PARENT_PID=str(os.getpid()),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        env.update({k: self.rewrite(service, k, str(v)) for k, v in self.services[service].get("environment", {}).items()})
        return env

    def command(self, service: str, argv: list[str]) -> list[str]:
        """`kvserve ...` as this interpreter runs it; other commands as they are."""
        argv = [self.rewrite(service, "", a) for a in argv]
        return [sys.executable, "-m", "kvserve.cli", *argv[1:]] if argv[0] == "kvserve" else argv

    def run_once(self, service: str) -> None:
        spec = self.services[service]
        argv = [*spec.get("entrypoint", ["kvserve"]), *spec["command"]]
        done = subprocess.run(self.command(service, argv), env=self.env(service), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{service}: {done.stdout}{done.stderr}"

    def start(self, service: str) -> None:
        spec = self.services[service]
        with open(self.tmp / "logs" / f"{service}.log", "wb") as log:
            self.processes[service] = subprocess.Popen(self.command(service, ["kvserve", *spec["command"]]),
                                                       env=self.env(service), stdout=log, stderr=subprocess.STDOUT)
        test = spec["healthcheck"]["test"]
        assert test[0] == "CMD"

        def log_tail() -> str:
            return (self.tmp / "logs" / f"{service}.log").read_text(errors="replace")[-3000:]

        def healthy() -> bool:
            assert self.processes[service].poll() is None, f"{service} exited:\n{log_tail()}"
            probe = subprocess.run(self.command(service, test[1:]), env=self.env(service), capture_output=True)
            return probe.returncode == 0

        wait_until(healthy, timeout_s=300, interval_s=0.5,
                   message=lambda: f"{service} did not become healthy:\n{log_tail()}")

    def addr(self, service: str) -> str:
        return f"127.0.0.1:{self.port(service, PORTS[service])}"

    def stop(self) -> None:
        from kvserve.stack.stack import remove_shm_leftovers

        for service, proc in reversed(self.processes.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if service == "kvstore":
                remove_shm_leftovers(proc.pid)


def _order(services: dict[str, Any]) -> list[str]:
    """The services in an order that starts each after what it depends on."""
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n, s in services.items() if n not in done and set(s.get("depends_on", {})) <= set(done)]
        assert ready, f"depends_on has a cycle or names a missing service: {sorted(set(services) - set(done))}"
        done += ready
    return done


@pytest.mark.slow
def test_the_compose_stack_answers_as_local_processes(tmp_path: Path) -> None:
    """The one-shots (credentials, model-init), Valkey, then each service with its command, variables and
    health check; the stack answers the admin token through the router over TLS, as a user on the host
    calls it with the CA and token the compose file's header says to take out, and refuses a caller with
    no token, a plaintext caller, and a metrics scraper without a certificate. The HTTP front answers the
    same token over HTTPS with the router's tokens, and refuses the same callers."""
    from tests.redis_fixtures import RedisServer

    spec = compose()
    stack = LocalCompose(spec, tmp_path)
    with contextlib.ExitStack() as cleanup:
        redis_command = spec["services"]["redis"]["command"]
        redis = cleanup.enter_context(RedisServer.start(tmp_path, extra=redis_command[1:]))
        stack.ports["redis", 6379] = redis.port
        assert redis.cli(*spec["services"]["redis"]["healthcheck"]["test"][2:]) == "PONG"
        assert redis.cli("CONFIG", "GET", "maxmemory-policy").split() == ["maxmemory-policy", "allkeys-lru"]
        cleanup.callback(stack.stop)
        _start_in_order(stack, spec)
        assert (stack.volumes["models"] / "tiny-llama" / "config.json").exists()

        ca, token_file = (Path(stack.rewrite("credentials", "", path)) for path in exported_files())
        token = token_file.read_text().strip()
        prompt = "The compose stack, run as local processes, answers through its front door. " * 2
        _check_the_grpc_front(stack, ca, token, prompt)
        _check_metrics_need_a_certificate(stack, ca)
        # written behind: wait for the first blocks to arrive
        wait_until(lambda: int(redis.cli("DBSIZE")) > 0, timeout_s=60, interval_s=0.2,
                   message="the store wrote nothing to the remote tier")

        skip_without_parser("http", "the HTTP front of the compose stack")
        _check_the_http_front(stack, spec, ca, token, prompt)


def _start_in_order(stack: LocalCompose, spec: dict[str, Any]) -> None:
    """Each one-shot run and each service started (Valkey is the caller's), after what it depends on."""
    for service in _order(spec["services"]):
        if spec["services"][service].get("restart") == "no":  # a one-shot
            stack.run_once(service)
        elif service == "http" and not has_parser("http"):
            continue  # until http_api lands: skipped at the end
        elif service != "redis":
            stack.start(service)


def _check_the_grpc_front(stack: LocalCompose, ca: Path, token: str, prompt: str) -> None:
    """The router answers the token over TLS as decode does, from the store the second time; no token, or
    plaintext, is refused."""
    from client import Client
    from client.client import KVServeError, UnauthenticatedError

    with Client(stack.addr("router"), token=token, tls_ca=ca) as front, \
            Client(stack.addr("decode"), token=token, tls_ca=ca) as decode:
        first = front.generate(prompt, max_tokens=8, ignore_eos=True)
        again = front.generate(prompt, max_tokens=8, ignore_eos=True)
        direct = decode.generate(prompt, max_tokens=8, ignore_eos=True)
    assert first.usage.completion_tokens == 8 and first.usage.cached_tokens == 0
    assert again.token_ids == direct.token_ids == first.token_ids
    assert again.usage.cached_tokens > 0  # the store kept the prompt's blocks
    with Client(stack.addr("router"), timeout_s=30, token="", tls_ca=ca) as anonymous, \
            pytest.raises(UnauthenticatedError):
        anonymous.generate(prompt, max_tokens=1)
    with Client(stack.addr("router"), timeout_s=30, token=token) as plaintext, pytest.raises(KVServeError):
        plaintext.generate(prompt, max_tokens=1)


def _check_metrics_need_a_certificate(stack: LocalCompose, ca: Path) -> None:
    metrics = f"https://127.0.0.1:{stack.port('kvstore', 9102)}/metrics"
    admin = ssl.create_default_context(cafile=str(ca))
    admin.load_cert_chain(*(stack.rewrite("credentials", "", f"/credentials/admin/{f}")
                            for f in ("admin.pem", "admin-key.pem")))
    with urllib.request.urlopen(metrics, context=admin, timeout=30) as page:
        assert b"kvserve_kvstore_" in page.read()
    with pytest.raises(OSError):  # no certificate from the CA: no metrics
        urllib.request.urlopen(metrics, context=ssl.create_default_context(cafile=str(ca)), timeout=30).read()


def _check_the_http_front(stack: LocalCompose, spec: dict[str, Any], ca: Path, token: str, prompt: str) -> None:
    """The HTTP front answers what the router streams, over HTTPS; no token is a 401, plain HTTP no answer."""
    from client import Client

    front_url = f"https://127.0.0.1:{stack.port('http', HTTP_PORT)}"
    with Client(stack.addr("router"), token=token, tls_ca=ca) as front:
        expected = front.generate(prompt, max_tokens=8)
    model = spec["services"]["http"]["environment"]["KVSERVE_HTTP_MODEL_NAME"]
    trusting = ssl.create_default_context(cafile=str(ca))
    assert https_json(f"{front_url}/v1/models", token, trusting)["data"][0]["id"] == model
    completion = https_json(f"{front_url}/v1/completions", token, trusting,
                            {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert completion["choices"][0]["text"] == expected.text  # greedy: what the router streamed
    assert completion["usage"]["completion_tokens"] == expected.usage.completion_tokens
    with pytest.raises(urllib.error.HTTPError) as refused:  # no token: decode refuses it
        https_json(f"{front_url}/v1/completions", "", trusting, {"model": model, "prompt": prompt, "max_tokens": 1})
    assert refused.value.code == 401
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to its HTTPS port
        https_json(f"http://127.0.0.1:{stack.port('http', HTTP_PORT)}/v1/models", token, None)

def https_json(url: str, token: str, context: ssl.SSLContext | None, body: dict[str, Any] | None = None) -> Any:
    """GET `url`, or POST `body` to it, as a caller with `token` (none when empty), trusting what `context` does;
    no proxy. Its JSON answer; urllib.error.HTTPError for a status other than 2xx."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    with opener.open(request, timeout=120) as answer:
        return json.loads(answer.read())
