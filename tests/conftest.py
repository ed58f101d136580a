import os
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


# The attention implementations a process chooses once (list attributes, empty until the first choice): default
# mode's CPU attention (ascend_ops.attention) and the batch-invariant mode's (ascend_ops.batch_invariant).
_ATTENTION_CHOICES = (("ascend_ops.attention", "_cpu_choice"), ("ascend_ops.batch_invariant", "_attention_choice"))


@pytest.fixture(autouse=True)
def _attention_choices_given_back():
    """Each test gets the process's attention choices back after it, whatever it selected: a test that forced the
    torch path and forgot to give it back left the later tests of the process on it (a failure that only one test
    order shows). A module imported during the test is left to choose afresh, as in a new process."""
    import sys

    kept = {(m, a): list(getattr(sys.modules[m], a)) for m, a in _ATTENTION_CHOICES if m in sys.modules}
    yield
    for m, a in _ATTENTION_CHOICES:
        if m in sys.modules:
            getattr(sys.modules[m], a)[:] = kept.get((m, a), [])


def pytest_configure(config):
    """Test servers get a KV cache sized for tests unless their flags size one (tests.serve_process)."""
    serve_process.SIZE_KV_FOR_TESTS = True


@pytest.hookimpl(trylast=True)  # after the durations table: the last lines CI shows
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line at the end of the run naming the CPU and the paths a CPU model computes on: CI shows the tail
    of its output, and a numeric failure that only one host kind shows is read against it."""
    import platform as py_platform

    import torch

    from ascend_ops import cpu_kernels, packed_linear

    model, ident = "?", {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                ident.setdefault(key.strip(), value.strip())
        model = ident.get("model name", "?")
    except OSError:
        model = py_platform.processor() or py_platform.machine()
    vendor = packed_linear._cpu_vendor() or "?"
    flags = cpu_kernels.cpu_flags()
    # the ISA extensions torch's, MKL's and oneDNN's own dispatch may pick kernels by, beside ours
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                               "amx_fp16", "amx_tf32", "avx_vnni", "avx_ne_convert") if f in flags) or "no AVX2"
    cpu = (f"family {ident.get('cpu family', '?')} model {ident.get('model', '?')} stepping "
           f"{ident.get('stepping', '?')}, {os.cpu_count()} CPUs, torch {torch.__version__} "
           f"{torch.backends.cpu.get_cpu_capability()} x{torch.get_num_threads()}")
    if not cpu_kernels.ops.cache_info().currsize:  # describing would build the kernels (the floors lane's torch)
        paths = "no CPU kernel ran in this run"
    else:
        try:
            isa_flags = " ".join(cpu_kernels.cflags()[3:]) or "portable"
            paths = f"fp32 linear {packed_linear.describe()}, kernels {isa_flags}"
        except Exception as e:  # noqa: BLE001 (a line of context must never fail the run)
            paths = f"compute paths unknown ({type(e).__name__})"
    terminalreporter.write_line(f"host: {model} ({vendor}; {isa}; {cpu}); {paths}")
