"""DESIGN.md, "Packages": who may import whom. The prefill service is reached only through the
client it publishes (`prefill_service.client`), as the store is through `KVStoreClient`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "engine", "kvstore", "prefill_service", "decode_service", "client")
# package -> the first-party modules it may import (a prefix ending in "." allows a whole package)
ALLOWED = {
    "engine": ("engine.",),
    "kvstore": ("kvstore.", "protos."),
    "prefill_service": ("prefill_service.", "engine.", "kvstore.", "protos."),
    "decode_service": ("decode_service.", "engine.", "kvstore.", "protos.", "prefill_service.client"),
}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_the_design_allows(package: str) -> None:
    allowed = ALLOWED[package]
    bad = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / package).glob("*.py")
        for name in imports(path)
        if not any(name == a.rstrip(".") or name.startswith(a) for a in allowed)
    }
    assert not bad, sorted(bad)
