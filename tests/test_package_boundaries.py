"""docs/DESIGN.md, "Packages": who may import whom, module by module.

Each package may import, besides its own modules, exactly the first-party modules listed here.
The store is reached only through its public package (`KVStoreClient`), the prefill service only
through `prefill_service.client`, and the request types both services use only from the neutral
`handoff.requests`. Third-party rules: no torch in the client, the shared server code or the store
(but its device tier), no grpc in the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "engine", "kvstore", "serving", "prefill_service", "decode_service", "router", "client")
PROTOS = {f"protos.kvserve.v1.{name}_pb2{grpc}" for name in ("common", "kvstore", "prefill", "decode")
          for grpc in ("", "_grpc")}
SERVING = {"rpc.addresses", "rpc.auth", "handoff.session", "rpc.cli", "rpc.errors", "rpc.metrics", "handoff.requests",
           "rpc.server", "rpc.tls"}
ENGINE_FOR_SERVICES = {"engine.engine", "engine.hashing", "handoff.codec", "engine.kv_pool", "handoff.transfer",
                       "engine.model", "engine.sampling", "engine.scheduler", "engine.sequence"}

ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "engine": {"protos.block_hash"},
    "kvstore": {"protos.block_hash", "rpc.cli", "rpc.server", "rpc.tls"} | PROTOS,
    # requests: the contract names engine's SamplingParams and encodes a prompt with the model's
    # tokenizer (prefill for its forward, decode for a router's prefix hashes); metrics: the engine's StepStats;
    # cache_session: the store's public client.
    "serving": {"protos.block_hash", "engine.model", "engine.sampling", "engine.engine", "kvstore"} | PROTOS,
    "prefill_service": {"protos.block_hash", "kvstore"} | ENGINE_FOR_SERVICES | SERVING | PROTOS,
    "decode_service": {"protos.block_hash", "kvstore", "prefill_service.client"}
    | ENGINE_FOR_SERVICES | SERVING | PROTOS,
    # the router holds no model: the shared server code without the request contract (which names the engine's)
    "router": {"protos.block_hash", "rpc.addresses", "rpc.cli", "rpc.errors", "rpc.server", "rpc.tls"} | PROTOS,
    "client": set(PROTOS),
}
# Modules allowed more than the rest of their package: the pytest plugin hands its users a client
# of the store too (its public package, which imports no torch).
ALLOWED_IN_MODULE: dict[str, set[str]] = {"client/pytest_plugin.py": {"kvstore"}}
FORBIDDEN_THIRD_PARTY = {
    "engine": {"grpc"},
    "serving": {"torch", "transformers"},
    "router": {"torch", "transformers"},
    "client": {"torch", "transformers"},
}
TORCH_IN_KVSTORE = {"device_tier.py", "device_bench.py"}  # torch (or cupy) only in the device tier and its bench


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """Every module `path` imports; `from a.b import c` names a.b.c when that is a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if node.module.split(".")[0] in PACKAGES and _is_module(full) else node.module)
    return names


def violations(package: str, paths: list[Path]) -> list[str]:
    """First-party imports of other packages, in `paths` of `package`, that the rules do not allow."""
    return sorted(
        f"{package}/{path.name}: {name}"
        for path in paths
        for name in imports(path)
        if name.split(".")[0] in PACKAGES and name.split(".")[0] != package
        and name not in ALLOWED[package] | ALLOWED_IN_MODULE.get(f"{package}/{path.name}", set())
    )


def test_every_package_has_a_rule() -> None:
    assert set(ALLOWED) == set(PACKAGES)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_the_design_allows(package: str) -> None:
    bad = violations(package, sorted((ROOT / package).glob("*.py")))
    assert not bad, bad


def test_the_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    """decode_service reaching into prefill_service's or the store's internals is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from prefill_service.service import PrefillService\nfrom kvstore.store import BlockStore\n"
                     "from prefill_service.client import PrefillClient\nfrom kvstore import KVStoreClient\n")
    assert violations("decode_service", [probe]) == [
        "decode_service/probe.py: kvstore.store", "decode_service/probe.py: prefill_service.service",
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN_THIRD_PARTY))
def test_packages_keep_out_of_forbidden_libraries(package: str) -> None:
    bad = sorted(f"{path.name}: {name}" for path in (ROOT / package).glob("*.py") for name in imports(path)
                 if name.split(".")[0] in FORBIDDEN_THIRD_PARTY[package])
    assert not bad, bad


def test_only_the_device_tier_imports_torch_in_the_store() -> None:
    users = {path.name for path in (ROOT / "kvstore").glob("*.py") if any(
        n.split(".")[0] in ("torch", "cupy") for n in imports(path))}
    assert users <= TORCH_IN_KVSTORE, sorted(users)
