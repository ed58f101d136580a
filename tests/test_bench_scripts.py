"""Every benchmark script answers `--help` with its usage: its arguments go through argparse, never read from
sys.argv by position (bench/fma_peak.py took `--help` for a thread count and died on int('--help'); step_parts_ab.py
took it for a checkout's path, vllm_peer.py for vLLM's Python)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def scripts() -> list[Path]:
    """The bench files meant to be run: those with an `if __name__ == "__main__":` block."""
    out = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            out.append(path)
    return out


def argv_reads(tree: ast.AST) -> list[str]:
    """`sys.argv[...]` and `len(sys.argv)` in the code: arguments read by position."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.argv" and isinstance(node.ctx, ast.Load):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and ast.unparse(node) == "len(sys.argv)":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.unit
def test_there_are_bench_scripts_to_check() -> None:
    names = {p.name for p in scripts()}
    assert {"rollout.py", "fma_peak.py", "step_parts_ab.py", "vllm_peer.py"} <= names, names


@pytest.mark.unit
@pytest.mark.parametrize("path", scripts(), ids=lambda p: p.name)
def test_a_bench_script_parses_its_arguments_with_argparse(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert "ArgumentParser" in {getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(tree)
                                if isinstance(n, ast.Call)}, f"{path.name}: no argparse.ArgumentParser"
    assert not argv_reads(tree), f"{path.name} reads sys.argv by position: {argv_reads(tree)}"


def test_fma_peak_answers_help_and_refuses_a_bad_thread_count() -> None:
    """The script the bug was found in, run for real (it imports no torch: a fraction of a second; a subprocess,
    so not in the unit lane)."""
    ok = subprocess.run([sys.executable, str(BENCH / "fma_peak.py"), "--help"], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: fma_peak.py"), ok.stderr
    bad = subprocess.run([sys.executable, str(BENCH / "fma_peak.py"), "two"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "invalid int value: 'two'" in bad.stderr, bad.stderr
