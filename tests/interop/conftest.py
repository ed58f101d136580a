"""The interop group (pytest -m interop): real RL clients, unmodified, from their own venvs, against one
`rollbus serve` shared by the modules here. Create the venvs with `bash tests/interop/setup_venvs.sh`;
without them the tests skip and say so."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.server_helpers import start_server

HERE = Path(__file__).resolve().parent
VENVS = Path(os.environ.get("ROLLBUS_INTEROP_VENVS", Path.home() / ".cache" / "rollbus-interop"))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def venv_python(name: str) -> Path:
    py = VENVS / name / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"the {name} venv is absent ({py}): create it with `bash tests/interop/setup_venvs.sh {name}`")
    return py


def run_client(python: Path, script: str, *args: str, timeout_s: float = 600) -> dict:
    """Run one of the client scripts here with that venv's python; its last stdout line is JSON."""
    p = subprocess.run([str(python), str(HERE / script), *args], capture_output=True, text=True, timeout=timeout_s,
                       cwd=str(HERE))  # not the repo root: the venv must not import rollbus's packages
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def interop_server(tmp_path_factory, smollm2_dir):
    """What TRL's and SkyRL's docs start vLLM with: dev endpoints (RL mode), a weight-transfer engine,
    the scale-out endpoints (SkyRL's /inference/v1/generate), sleep mode."""
    s = start_server(tmp_path_factory.mktemp("interop"), "--additional-config", '{"rl_config": {"enabled": true}}',
                     "--max-model-len", "1024", "--weight-transfer-config", '{"backend": "nccl"}',
                     "--enable-scale-out", "--enable-sleep-mode", "--max-logprobs", "-1")
    yield s
    s.stop()
