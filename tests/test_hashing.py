import hashlib
import json
import struct
import subprocess
import sys

import pytest

from kvserve.bench import hashing as bench
from kvserve.engine.hashing import BLOCK_FORMAT_VERSION, Namespace, hash_block_tokens, prefix_hashes

NS = Namespace(model_fingerprint="ab" * 32, kv_dtype="float32", block_size=4, cache_salt="tenant-a")
TOKENS = [0, 1, 2, 3, 4, 5, 6, 7, 2**32 - 1, 65536, 9, 10, 11]

_CHILD = """
import json, sys
from kvserve.engine.hashing import Namespace, prefix_hashes
ns = Namespace(model_fingerprint="ab" * 32, kv_dtype="float32", block_size=4, cache_salt="tenant-a")
print(json.dumps([h.hex() for h in prefix_hashes(json.loads(sys.argv[1]), 4, ns.root())]))
"""


def test_chain_is_sha256_of_parent_and_uint32_le_tokens() -> None:
    root = NS.root()
    hashes = prefix_hashes(TOKENS, 4, root)
    assert len(hashes) == 3  # 13 tokens: three full blocks, the partial block gets no hash
    parent = root
    for i, h in enumerate(hashes):
        expected = hashlib.sha256(parent + struct.pack("<4I", *TOKENS[4 * i : 4 * i + 4])).digest()
        assert h == expected == hash_block_tokens(parent, TOKENS[4 * i : 4 * i + 4])
        parent = h


def test_root_is_sha256_of_canonical_namespace() -> None:
    canonical = json.dumps(
        {"block_size": 4, "cache_salt": "tenant-a", "format_version": BLOCK_FORMAT_VERSION, "kv_dtype": "float32",
         "model_fingerprint": "ab" * 32},
        separators=(",", ":"),
    ).encode()  # fmt: skip
    assert NS.root() == hashlib.sha256(b"kvserve/namespace\x00" + canonical).digest()


def test_identical_in_separate_processes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(TOKENS)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [h.hex() for h in prefix_hashes(TOKENS, 4, NS.root())]


@pytest.mark.parametrize(
    "changed",
    [
        Namespace("ab" * 32, "float32", 4, cache_salt="tenant-b"),
        Namespace("cd" * 32, "float32", 4, cache_salt="tenant-a"),
        Namespace("ab" * 32, "bfloat16", 4, cache_salt="tenant-a"),
        Namespace("ab" * 32, "float32", 8, cache_salt="tenant-a"),
        Namespace("ab" * 32, "float32", 4, cache_salt="tenant-a", format_version=BLOCK_FORMAT_VERSION - 1),
    ],
)
def test_any_namespace_change_changes_every_hash(changed: Namespace) -> None:
    tokens = list(range(32))
    ours = prefix_hashes(tokens, 4, NS.root())
    theirs = prefix_hashes(tokens, 4, changed.root())
    assert changed.root() != NS.root()
    assert not set(ours) & set(theirs)


def test_prefix_property_and_partial_blocks() -> None:
    root = NS.root()
    assert prefix_hashes(TOKENS[:8], 4, root) == prefix_hashes(TOKENS, 4, root)[:2]
    assert prefix_hashes(TOKENS[:3], 4, root) == []
    other = [*TOKENS[:5], 99, *TOKENS[6:]]  # differs in block 1: block 0 shared, the rest diverge
    a, b = prefix_hashes(TOKENS, 4, root), prefix_hashes(other, 4, root)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        prefix_hashes([-1, 0, 0, 0], 4, NS.root())
    with pytest.raises(ValueError):
        prefix_hashes([2**32, 0, 0, 0], 4, NS.root())
    with pytest.raises(ValueError):
        hash_block_tokens(NS.root()[:16], [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Namespace("ab", "float32", 0)


def test_bench_hash_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--tokens", "4096", "--repeat", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 4096 and result["prefix_hashes_ns_per_token"] > 0
