"""Integration-test helpers around the real engine (see tests.serve_process)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from tests.serve_process import Server, free_port, sized_for_tests, start_server  # noqa: F401  (re-exported for tests)


def tiny_model_with_tokenizer(arch: str, folder: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A tiny random checkpoint with a real tokenizer beside it, servable by the gateway. `overrides` go to
    make_tiny_checkpoint (vocab_size=<the tokenizer's> makes text prompts valid)."""
    from tests.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(arch, folder, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
