#!/usr/bin/env bash
# The checks that need an accelerator, as one prepared run on a lent device machine (the `device` tool's `run`,
# at most 8 minutes; `bash bench/device_wheels.sh` here first, then carry `.whl`):
#   run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=540)
# 1. the platform: torch sees the GPU, rollbus's platform layer picks it (ROLLBUS_DEVICE=cuda)
# 2. the unit and end-to-end tests that run the model on the device: the HF oracles, batch invariance, sleep and
#    weight updates over real processes (tiny models; each file under its own time limit)
# 3. workload A at Qwen3-0.6B's shape (--load-format dummy, bf16) over HTTP, against HF generate in the same run.
#    vLLM's CUDA wheel (330 MB) cannot travel (64 MiB a call), so the vLLM row needs a machine that can install it.
# Logs go to $OUT (they come back even when a step times out).
set -uo pipefail
OUT="${OUT:-/tmp/device-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ROLLBUS_DEVICE=cuda
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (log $name.log)" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
step platform 60 python3 -c "
import torch; from ascend_ops.platform import current_platform
p = current_platform(); print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'platform', p.name, p.device_count())
assert p.name == 'cuda', p"
step tests 240 python3 -m pytest -q -x -p no:cacheprovider -m "not slow and not interop and not fleet" \
  tests/test_model_oracle.py tests/test_moe_oracle.py tests/test_logprobs_oracle.py tests/test_batch_invariance.py \
  tests/test_engine_e2e.py tests/test_sleep.py tests/test_weight_update.py tests/test_weight_sync.py
step rollout_qwen3_0_6b 200 python3 bench/rollout.py --dtypes bfloat16 --shape qwen3-0.6b --num-prompts 64 \
  --max-tokens 64 --json "$OUT/rollout.json"
cat "$OUT/summary.txt"
