"""What installing kvserve puts in a Python environment: the design card's five packages and `kvserve`, no
more (generic names such as `engine` or `router` would collide with other distributions' modules)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"protos", "kvstore", "prefill_service", "decode_service", "client", "kvserve"}


@pytest.mark.slow
def test_the_wheel_installs_the_design_cards_packages_and_kvserve_alone(tmp_path: Path) -> None:
    source = tmp_path / "source"  # the working tree's tracked files, not its build leftovers
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file() and not name.startswith(("data/", "docs/bench/")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("kvserve-*.whl")
    venv.create(tmp_path / "env", with_pip=False)
    python = tmp_path / "env" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    installed = {path.name.removesuffix(".py") for path in site.iterdir()
                 if not path.name.endswith((".dist-info", ".pth")) and path.name != "__pycache__"}
    assert installed == TOP_LEVEL
    assert (site / "kvserve" / "engine" / "native.c").is_file()  # the kernel's source ships with it
