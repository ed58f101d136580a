"""The import floors (docs/architecture.md "Import floors"): walk every import of rollbus's packages (ast,
without importing anything; imports inside functions and under TYPE_CHECKING count too) and fail on an import that
points up a floor, across a floor's two sides, round a circle, or at a module that does not exist.

    python .ci/check_imports.py

Floors, lowest first; a module may import its own floor and the ones below:
    0  ascend_ops (devices, kernels)          bus (the wire)          -- neither imports the other
    1  engine (config, scheduler, coordinator, the trainer's client)
    2  workers (the worker process)          gateway (the HTTP process)  -- neither imports the other
    3  engine.cli, engine.launcher: the entry points, which start every role
Exit status 1 with one line per offending import (file:line), 0 when the floors hold.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ascend_ops", "bus", "engine", "workers", "gateway")
FLOOR = {"ascend_ops": 0, "bus": 0, "engine": 1, "workers": 2, "gateway": 2}
ENTRY_POINTS = {"engine.cli": 3, "engine.launcher": 3}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The project modules `name` imports, with the line of each import."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` names a module when mod is one, else something inside pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES and target not in known:  # moved or deleted: fails at run time
                found.append((f"?{target}", node.lineno))
                continue
            while target and target not in known:  # `import a.b.c` of a package: its deepest known module
                target = target.rpartition(".")[0]
            if target and target != name and (target, node.lineno) not in found:
                found.append((target, node.lineno))
    return found


def floor(module: str) -> int:
    return ENTRY_POINTS.get(module, FLOOR[module.split(".")[0]])


def problems(root: Path = ROOT) -> list[str]:
    known = modules(root)
    graph: dict[str, set[str]] = {}
    out = []
    for name, path in known.items():
        graph[name] = set()
        for target, line in imports(name, path, known):
            if target.startswith("?"):
                out.append(f"{path.relative_to(root)}:{line}: {name} imports {target[1:]}, which is not a module")
                continue
            graph[name].add(target)
            mine, theirs = floor(name), floor(target)
            side = name.split(".")[0] != target.split(".")[0] and mine == theirs and mine in (0, 2)
            if theirs > mine or side:
                where = f"{path.relative_to(root)}:{line}"
                what = "across floor" if side else "up from floor"
                out.append(f"{where}: {name} imports {target} ({what} {mine}: {theirs} is "
                           f"{'beside' if side else 'above'} it)")
    for cycle in cycles(graph):
        out.append("import circle: " + " -> ".join([*cycle, cycle[0]]))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each listed in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    found = problems()
    for p in found:
        print(p)
    if found:
        print(f"{len(found)} import problem(s): see docs/architecture.md \"Import floors\"", file=sys.stderr)
        return 1
    print(f"import floors hold ({len(modules())} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
