"""`--additional-config '{"rl_config": {...}}'`: vLLM-Ascend's RL switch, parsed and validated once.

Pure: no environment is changed here. `worker_env_updates` says what a worker must change in its own
environment before it touches the device allocator; `determinism` says whether batch invariance is on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

RL_KEYS = ("enabled", "sleep_mode_extra_cleanup", "enable_training_consistency", "enable_batch_invariant")
ALLOC_CONF_VARS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass(frozen=True, slots=True)
class RLConfig:
    enabled: bool = False
    sleep_mode_extra_cleanup: bool = False
    enable_training_consistency: bool = False
    enable_batch_invariant: bool = False

    def effective(self) -> dict[str, bool]:
        """The optional switches count only under the master switch."""
        on = self.enabled
        return {"enabled": on, "sleep_mode_extra_cleanup": on and self.sleep_mode_extra_cleanup,
                "enable_training_consistency": on and self.enable_training_consistency,
                "enable_batch_invariant": on and self.enable_batch_invariant}


@dataclass(frozen=True, slots=True)
class AdditionalConfig:
    rl: RLConfig = field(default_factory=RLConfig)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_nz_mode(self) -> int:
        """Ascend FRACTAL_NZ weight layout: forced off in RL mode (weights are updated in place)."""
        return 0 if self.rl.enabled else int(self.raw.get("weight_nz_mode", 0))


def parse_additional_config(text: str | None) -> AdditionalConfig:
    """Raises ValueError with vLLM-Ascend's messages on anything invalid."""
    if not text:
        return AdditionalConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--additional-config is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--additional-config must be a JSON object, got {type(raw).__name__}.")
    if "enable_sleep_mode_extra_cleanup" in raw:
        raise ValueError("additional_config.enable_sleep_mode_extra_cleanup has been removed; use "
                         "rl_config.sleep_mode_extra_cleanup (with rl_config.enabled=true) instead.")
    rl = raw.get("rl_config", {})
    if not isinstance(rl, dict):
        raise ValueError(f"additional_config.rl_config must be a dict, got {type(rl).__name__}.")
    unknown = sorted(set(rl) - set(RL_KEYS))
    if unknown:
        raise ValueError(f"Unknown rl_config keys: {unknown}")
    for k, v in rl.items():
        if not isinstance(v, bool):
            raise ValueError(f"rl_config.{k} must be a bool, got {type(v).__name__}.")
    return AdditionalConfig(RLConfig(**rl), raw)


def dev_endpoints_enabled(cfg: AdditionalConfig, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    try:
        dev = int(env.get("VLLM_SERVER_DEV_MODE", "0") or 0) != 0
    except ValueError:
        dev = False
    return dev or cfg.rl.enabled


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
# What a worker sets for deterministic collectives and GEMMs when batch invariance is on: vLLM-Ascend's
# HCCL/LCCL settings, vLLM's cuBLAS workspace (no split-K that depends on free workspace).
DETERMINISTIC_ENV = {"VLLM_BATCH_INVARIANT": "1", "HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1",
                     "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@dataclass(frozen=True, slots=True)
class Determinism:
    """Which of the deterministic modes are on, and what turned batch invariance on."""

    batch_invariant: bool = False
    training_consistency: bool = False
    source: str | None = None  # "rl_config.enable_batch_invariant" | "VLLM_BATCH_INVARIANT=1" | ...

    def as_json(self) -> dict[str, Any]:
        return {"batch_invariant": self.batch_invariant, "training_consistency": self.training_consistency,
                "source": self.source}


def determinism(cfg: AdditionalConfig, environ: dict[str, str] | None = None) -> Determinism:
    """Batch invariance is on with rl_config.enable_batch_invariant (under `enabled`) or, as in vLLM, with
    VLLM_BATCH_INVARIANT set to a non-zero integer. Raises ValueError on what cannot be honoured."""
    env = os.environ if environ is None else environ
    raw = (env.get(BATCH_INVARIANT_ENV) or "0").strip()
    try:
        env_on = bool(int(raw))  # vLLM: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
    except ValueError:
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be an integer (0 or 1), as vLLM reads it; got {raw!r}") from None
    eff = cfg.rl.effective()
    if eff["enable_training_consistency"]:  # the engine runs the kernels engine.trainer.use_engine_kernels installs
        return Determinism(True, True, "rl_config.enable_training_consistency")
    if eff["enable_batch_invariant"]:
        return Determinism(True, False, "rl_config.enable_batch_invariant")
    if env_on:
        return Determinism(True, False, f"{BATCH_INVARIANT_ENV}={raw}")
    return Determinism()


def worker_env_updates(cfg: AdditionalConfig, environ: dict[str, str]) -> dict[str, str | None]:
    """Env changes for a worker: in RL mode expandable_segments off (it breaks the sleep-mode pool) and NZ
    off; with batch invariance the deterministic settings (DETERMINISTIC_ENV). None means unset the variable."""
    out: dict[str, str | None] = {}
    if cfg.rl.enabled:
        out["VLLM_ASCEND_ENABLE_NZ"] = "0"
        for var in ALLOC_CONF_VARS:
            if var in environ:
                kept = [p for p in environ[var].split(",") if p and not p.strip().startswith("expandable_segments")]
                out[var] = ",".join(kept) if kept else None
    if determinism(cfg, environ).batch_invariant:
        out.update(DETERMINISTIC_ENV)
    return out
