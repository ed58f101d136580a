"""The lowest-versions lane installs .ci/floors.txt; this keeps that file equal to pyproject.toml's floors
(every direct dependency, test extra included, pinned at its ">=" bound), and, inside the lane
(ROLLBUS_FLOORS_LANE=1), checks that the floors are what is actually installed."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PINNED_ELSEWHERE = {"torch"}  # installed from the local CPU build (torch==2.13.0) by every install command


def pyproject_floors() -> dict[str, tuple[str, str]]:
    """{name: (floor, marker)} of the project's dependencies and its test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {}
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in PINNED_ELSEWHERE:
            continue
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert len(floors) == 1, f"{line!r}: every dependency needs exactly one '>=' floor"
        out[name] = (str(Version(floors[0])), str(req.marker or ""))
    return out


def floors_file() -> dict[str, tuple[str, str]]:
    out = {}
    for raw in (ROOT / ".ci" / "floors.txt").read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"floors.txt: {line!r} must pin with =="
        out[canonicalize_name(req.name)] = (str(Version(spec.version)), str(req.marker or ""))
    return out


def test_floors_file_pins_exactly_the_pyproject_floors() -> None:
    want, have = pyproject_floors(), floors_file()
    expected = "\n".join(f"{n}=={v}{'; ' + m if m else ''}" for n, (v, m) in want.items())
    assert have == want, f".ci/floors.txt should pin (one line each):\n{expected}"


@pytest.mark.skipif(os.environ.get("ROLLBUS_FLOORS_LANE") != "1", reason="only in the lowest-versions lane")
def test_the_lane_runs_on_the_floors() -> None:
    wrong = {}
    for name, (floor, marker) in floors_file().items():
        if marker and not Requirement(f"x; {marker}").marker.evaluate():  # type: ignore[union-attr]
            continue
        installed = importlib.metadata.version(name)
        if Version(installed) != Version(floor):
            wrong[name] = f"{installed} installed, floor {floor}"
    assert wrong == {}
