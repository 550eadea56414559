"""docs/DESIGN.md, "Packages": dependencies point one way.

The packages are layers, bottom to top (LAYERS); each imports only the packages below it that its rule
names (MAY_IMPORT), so no two packages import each other, and no module of a package is in an import
cycle with others (imports inside functions and under TYPE_CHECKING count). No module is exempt: the
`kvserve` command (kvserve.cli) is the top layer. The store is reached only through its public package
(`KVStoreClient`) and its program, but by the stack and the benchmarks, which start it; the prefill
service only through `prefill_service.client` and its program. Third-party: no torch in the RPC plumbing, the
router (it holds no model), the client or the stack; no grpc in the engine; torch (or cupy) in the
store only in its device tier.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The design card's packages at the top of the repo, and what else there is under `kvserve`; a unit is a
# top-level package or a package (or module) directly under kvserve/.
LAYERS = ("protos", "kvserve.host", "kvserve.rpc", "kvserve.engine", "kvstore", "kvserve.handoff", "prefill_service",
          "decode_service", "kvserve.router", "client", "kvserve.http", "kvserve.stack", "kvserve.bench",
          "kvserve.pytest_plugin", "kvserve.cli")
MAY_IMPORT: dict[str, set[str]] = {
    "protos": set(),
    "kvserve.host": set(),  # the process's set-up and the host's shared cores; no grpc
    "kvserve.rpc": {"protos", "kvserve.host"},
    "kvserve.engine": {"protos", "kvserve.host"},
    "kvstore": {"protos", "kvserve.host", "kvserve.rpc"},
    "kvserve.handoff": {"protos", "kvserve.rpc", "kvserve.engine", "kvstore"},
    "prefill_service": {"protos", "kvserve.host", "kvserve.rpc", "kvserve.engine", "kvstore", "kvserve.handoff"},
    "decode_service": {"protos", "kvserve.host", "kvserve.rpc", "kvserve.engine", "kvstore", "kvserve.handoff",
                       "prefill_service"},
    "kvserve.router": {"protos", "kvserve.host", "kvserve.rpc"},  # it holds no model
    "client": {"protos"},  # the client library: Client, its credentials, the metrics page reader
    "kvserve.http": {"protos", "kvserve.host", "kvserve.rpc", "client"},  # OpenAI's HTTP API in front of the gRPC one: no model either
    # It starts the services as `python -m` processes, with credentials it makes; the engine's model helpers
    # (fetch, check) are stdlib only.
    "kvserve.stack": {"protos", "kvserve.rpc", "kvserve.engine", "kvstore", "client"},
    "kvserve.bench": {"protos", "kvserve.host", "kvserve.rpc", "kvserve.engine", "kvstore", "kvserve.handoff",
                      "prefill_service", "decode_service", "kvserve.router", "client", "kvserve.http", "kvserve.stack"},
    "kvserve.pytest_plugin": {"kvserve.rpc", "kvserve.engine", "kvstore", "client", "kvserve.stack"},
    "kvserve.cli": set(LAYERS[:-1]),  # the `kvserve` command: each service's `__main__` and every benchmark
}
# The only modules of these packages that other packages import (the store's public package holds KVStoreClient).
PUBLIC = {"kvstore": {"kvstore", "kvstore.__main__"},
          "prefill_service": {"prefill_service.client", "prefill_service.__main__"}}
STARTERS = {"kvserve.stack", "kvserve.bench"}  # they start the store, so they may reach into it
NEVER = ({package: {"torch", "transformers"} for package in ("kvserve.rpc", "kvserve.router", "client", "kvserve.http",
                                                           "kvserve.stack", "kvserve.cli")}
         | {"kvserve.engine": {"grpc"}, "kvserve.host": {"grpc"}})
TORCH_IN_KVSTORE = {"kvstore.device_tier"}


def unit(module: str) -> str:
    """The layer a module belongs to: its top-level package, or under kvserve/ the package or module below it."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvserve" and len(parts) > 1 else parts[0]


def module_paths(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` under `root` by its dotted name (a package by its own)."""
    paths = {}
    for package in packages:
        for path in _files(root / package.replace(".", "/")):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return paths


def _files(base: Path) -> Iterable[Path]:
    return [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else base.rglob("*.py")


def imported_names(name: str, path: Path) -> set[str]:
    """Every name module `name` imports anywhere in its file; `from a import b` names a.b (a module or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from `level` packages up, the first being the module's own
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_graph(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (`a.b.c` counts as the longest of a.b.c, a.b, a that is one)."""
    paths = module_paths(root, packages)

    def module_of(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    return {name: {m for n in imported_names(name, path) if (m := module_of(n)) and m != name}
            for name, path in paths.items()}


def violations(graph: Mapping[str, set[str]]) -> list[str]:
    """The imports the rules forbid: of a package MAY_IMPORT does not name, of a module another package keeps
    to itself."""
    bad = []
    for name, imported in graph.items():
        package = unit(name)
        for other in imported:
            target = unit(other)
            if target == package:
                continue
            if target not in MAY_IMPORT[package]:
                bad.append(f"{name} -> {other}: {package} may not import {target}")
            elif target in PUBLIC and other not in PUBLIC[target] and package not in STARTERS:
                bad.append(f"{name} -> {other}: only {', '.join(sorted(PUBLIC[target]))} of {target}")
    return sorted(bad)


def package_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for name, imported in graph.items():
        packages.setdefault(unit(name), set()).update(unit(m) for m in imported if unit(m) != unit(name))
    return packages


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every import cycle: the strongly connected components of more than one node."""
    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            if (node := todo.pop()) not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return seen

    reach = {node: reachable(node) for node in graph}
    components = {frozenset(n for n in reach[node] if node in reach.get(n, ())) for node in graph if node in reach[node]}
    return sorted(sorted(component) for component in components)


GRAPH = module_graph()


def test_each_package_may_import_only_packages_below_it() -> None:
    assert list(MAY_IMPORT) == list(LAYERS)
    assert {p: MAY_IMPORT[p] - set(LAYERS[: LAYERS.index(p)]) for p in LAYERS} == {p: set() for p in LAYERS}


def test_the_programs_pyproject_names_are_the_top_layers() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [*project["scripts"].values(), *project["entry-points"]["pytest11"].values()]
    assert {unit(target.split(":")[0]) for target in named} == {"kvserve.cli", "kvserve.pytest_plugin"}


def test_imports_follow_the_layers() -> None:
    bad = violations(GRAPH)
    assert not bad, bad


def test_no_cycle_between_packages() -> None:
    assert cycles(package_graph(GRAPH)) == []


def test_no_cycle_between_modules() -> None:
    assert cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them inside a function; and two packages."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__init__.py").write_text("")
    (tmp_path / "probe" / "a.py").write_text("def f() -> None:\n    from probe import b\n")
    (tmp_path / "probe" / "b.py").write_text("from probe.a import f\n")
    (tmp_path / "probe" / "c.py").write_text("import probe.b\n")
    assert cycles(module_graph(tmp_path, ["probe"])) == [["probe.a", "probe.b"]]
    assert cycles({"protos": set(), "rpc": {"protos", "engine"}, "engine": {"protos", "rpc"}}) == [["engine", "rpc"]]


def test_the_rules_catch_forbidden_imports() -> None:
    graph = {
        "kvserve.rpc.metrics": {"kvserve.engine.engine", "kvserve.rpc.errors"},
        "decode_service.service": {"prefill_service.service", "prefill_service.client", "kvstore.store", "kvstore"},
        "kvserve.bench.target": {"kvserve.cli.commands", "kvstore.client"},
        "kvserve.cli.commands": {"kvserve.bench.prefill", "kvstore.__main__", "kvserve.cli.health"},
        "client.client": {"kvserve.stack.stack"},
    }
    assert violations(graph) == [
        "client.client -> kvserve.stack.stack: client may not import kvserve.stack",
        "decode_service.service -> kvstore.store: only kvstore, kvstore.__main__ of kvstore",
        "decode_service.service -> prefill_service.service: only prefill_service.__main__, prefill_service.client "
        "of prefill_service",
        "kvserve.bench.target -> kvserve.cli.commands: kvserve.bench may not import kvserve.cli",
        "kvserve.rpc.metrics -> kvserve.engine.engine: kvserve.rpc may not import kvserve.engine",
    ]


@pytest.mark.parametrize("package", sorted(NEVER))
def test_packages_keep_out_of_forbidden_libraries(package: str) -> None:
    bad = sorted(f"{name}: {n}" for name, path in module_paths(ROOT, [package]).items()
                 for n in imported_names(name, path) if n.split(".")[0] in NEVER[package])
    assert not bad, bad


def test_only_the_device_tier_imports_torch_in_the_store() -> None:
    users = {name for name, path in module_paths(ROOT, ["kvstore"]).items()
             if any(n.split(".")[0] in ("torch", "cupy") for n in imported_names(name, path))}
    assert users <= TORCH_IN_KVSTORE, sorted(users)
