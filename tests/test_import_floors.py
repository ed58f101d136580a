"""The import floors (.ci/check_imports.py, docs/architecture.md "Import floors") hold for the code as it is,
and the check catches what it is for: an import up a floor, one across a floor's two sides, a circle, and an import
of a module that is not there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / ".ci" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_code_keeps_its_import_floors():
    assert _checker().problems() == []


def test_the_check_names_upward_and_sideways_imports_and_circles(tmp_path):
    files = {
        "bus/__init__.py": "",
        "bus/wire.py": "from engine import config\n",  # up a floor
        "ascend_ops/__init__.py": "",
        "ascend_ops/ops.py": "import bus.wire\n",  # across floor 0
        "engine/__init__.py": "",
        "engine/config.py": "def f():\n    from engine.argv import parse\n",  # a circle, through a lazy import
        "engine/argv.py": "from . import config\n",
        "engine/cli.py": "import gateway.app\nimport workers.run\n",  # an entry point: may import anything
        "workers/__init__.py": "",
        "workers/run.py": "from gateway import app\n",  # across floor 2
        "gateway/__init__.py": "",
        "gateway/app.py": "from engine import config\nfrom bus.wire import x\n",  # down: fine
        "gateway/old.py": "from engine.moved import thing\n",  # a module that is not there (any more)
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = _checker().problems(tmp_path)
    assert any(p.startswith("bus/wire.py:1: bus.wire imports engine.config (up from floor 0") for p in found), found
    assert any(p.startswith("ascend_ops/ops.py:1: ascend_ops.ops imports bus.wire (across floor 0") for p in found)
    assert any(p.startswith("workers/run.py:1: workers.run imports gateway.app (across floor 2") for p in found)
    assert "import circle: engine.argv -> engine.config -> engine.argv" in found
    assert "gateway/old.py:1: gateway.old imports engine.moved, which is not a module" in found
    assert not any(p.startswith(("engine/cli.py", "gateway/app.py")) for p in found), found
    assert len(found) == 5, found
