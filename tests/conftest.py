import subprocess

# numpy 1.26 (the floor) runs `lscpu` on the first import of numpy.testing: import it before the unit
# lane's no-subprocess guard below is in force.
import numpy.testing  # noqa: F401
import pytest

from tests import serve_process
from tests.fixtures_models import qwen3_tok, smollm2_dir, smollm2_gguf, smollm2_moe_dir  # noqa: F401  (shared fixtures)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """The `unit` lane stays in this process: a unit-marked test that starts a subprocess (a server, a
    coordinator, a gloo peer) fails, so the lane cannot grow slow or flaky unnoticed. Session fixtures
    (the model cache) are set up before this and may still fetch."""
    if request.node.get_closest_marker("unit") is not None:
        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} is marked unit but starts a subprocess: "
                                 "move it out of the unit lane or drop the process")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)


def pytest_configure(config):
    """Test servers get a KV cache sized for tests unless their flags size one (tests.serve_process)."""
    serve_process.SIZE_KV_FOR_TESTS = True
