"""verl's rollout config (`actor_rollout_ref.rollout`, a RolloutConfig) as the vLLM serve Namespace that
engine.fleet.serve_args turns into `rollbus serve` flags. Pure: no Ray, no verl (the config is read by
attribute, so a RolloutConfig, an OmegaConf node or a SimpleNamespace all work).

What maps (verl field -> vLLM attribute): tensor_model_parallel_size -> tensor_parallel_size, dtype,
max_model_len (else prompt_length + response_length, as verl's vLLM server), max_num_seqs,
max_num_batched_tokens, gpu_memory_utilization, enable_chunked_prefill, enable_prefix_caching,
enforce_eager, seed, load_format, disable_log_stats, logprobs_mode, scheduling_policy,
cudagraph_capture_sizes, served_model_name, enable_sleep_mode (when free_cache_engine), and
skip_tokenizer_init -> tokens_only (no tokenizer; verl's server generates tokens in, tokens out).
`engine_kwargs.rollbus` adds or overrides vLLM serve attributes (refused by name when rollbus refuses them).
Every engine gets RL mode and one weight-transfer backend: the collective one with
`checkpoint_engine.backend=rollbus`, else ipc (what the server adapter sends).

Refused, naming the field: what a rollbus replica cannot be (data / pipeline / expert parallelism inside
one replica, prefill-decode disaggregation, MTP speculative decoding, routing replay, LoRA adapters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIELD = "actor_rollout_ref.rollout"
# verl field -> vLLM serve attribute, copied when set (None means "the engine's default")
PASS_THROUGH = {
    "tensor_model_parallel_size": "tensor_parallel_size",
    "dtype": "dtype",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_prefix_caching": "enable_prefix_caching",
    "enforce_eager": "enforce_eager",
    "seed": "seed",
    "load_format": "load_format",
    "disable_log_stats": "disable_log_stats",
    "logprobs_mode": "logprobs_mode",
    "scheduling_policy": "scheduling_policy",
    "cudagraph_capture_sizes": "cudagraph_capture_sizes",
    "served_model_name": "served_model_name",
}


class VerlConfigError(ValueError):
    """A verl rollout setting a rollbus replica cannot honour; the message names the field."""


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if obj is None:
            return default
        # dicts, OmegaConf nodes and verl's BaseConfig have .get; other objects are read by attribute
        obj = obj.get(part, None) if hasattr(obj, "get") else getattr(obj, part, None)
    return default if obj is None else obj


def weight_backend(name: str | None = None) -> str:
    """The collective backend of rollbus's weight sync: as given, else by this host's devices (NCCL on
    CUDA, HCCL on Ascend, Gloo on CPU). rollbus treats the three as one collective path."""
    if name and name != "auto":
        if name not in ("gloo", "nccl", "hccl"):
            raise VerlConfigError(f"{FIELD}.checkpoint_engine.engine_kwargs.rollbus.backend: {name!r} is not one of "
                                  "auto, gloo, nccl, hccl")
        return name
    if any(Path(p).exists() for p in ("/dev/davinci0", "/dev/davinci_manager")):
        return "hccl"
    return "nccl" if Path("/dev/nvidia0").exists() else "gloo"


def check_rollout(rollout: Any, model: Any = None) -> None:
    """Refuse what a rollbus replica cannot be, naming the verl field."""
    checks = [
        ("data_parallel_size", _get(rollout, "data_parallel_size", 1) != 1,
         "data parallelism inside one replica; run more replicas (more GPUs) instead"),
        ("pipeline_model_parallel_size", _get(rollout, "pipeline_model_parallel_size", 1) != 1,
         "pipeline parallelism is not supported by rollbus"),
        ("expert_parallel_size", _get(rollout, "expert_parallel_size", 1) != 1,
         "expert parallelism is not supported by rollbus"),
        ("disaggregation.enabled", bool(_get(rollout, "disaggregation.enabled", False)),
         "prefill-decode disaggregation is not supported by rollbus"),
        ("mtp.enable", bool(_get(rollout, "mtp.enable", False)),
         "MTP speculative decoding is not supported by rollbus"),
        ("enable_rollout_routing_replay", bool(_get(rollout, "enable_rollout_routing_replay", False)),
         "routing replay is not wired into the rollbus backend"),
        ("quantization_config_file", bool(_get(rollout, "quantization_config_file")),
         "a quantization config file is not supported by rollbus"),
    ]
    for name, bad, why in checks:
        if bad:
            raise VerlConfigError(f"{FIELD}.{name}={_get(rollout, name)!r}: {why}")
    if model is not None and (int(_get(model, "lora_rank", 0) or 0) > 0 or int(_get(model, "lora.rank", 0) or 0) > 0):
        raise VerlConfigError("actor_rollout_ref.model.lora_rank: LoRA adapters are not supported by the rollbus "
                              "backend")


def serve_namespace(rollout: Any, model_path: str, model: Any = None) -> dict[str, Any]:
    """vLLM serve attributes for one rollbus engine of this rollout config (VerlConfigError naming a field
    rollbus cannot honour; serve_args then refuses what the command line refuses)."""
    check_rollout(rollout, model)
    ns: dict[str, Any] = {"model": model_path}
    for field, attr in PASS_THROUGH.items():
        value = _get(rollout, field)
        if value is not None:
            ns[attr] = list(value) if field == "cudagraph_capture_sizes" else value
    default_len = _get(rollout, "prompt_length", 512) + _get(rollout, "response_length", 512)
    ns["max_model_len"] = int(_get(rollout, "max_model_len") or default_len)
    if _get(rollout, "enable_sleep_mode", True) and _get(rollout, "free_cache_engine", True):
        ns["enable_sleep_mode"] = True
    if _get(rollout, "skip_tokenizer_init", False):
        ns["tokens_only"] = True
    # an engine takes one transfer backend: the collective one the `rollbus` checkpoint engine drives, else
    # ipc, for tensors verl hands the server adapter (its colocated `naive` sync, or another checkpoint engine)
    if _get(rollout, "checkpoint_engine.backend") == "rollbus":
        backend = weight_backend(_get(rollout, "checkpoint_engine.engine_kwargs.rollbus.backend"))
    else:
        backend = "ipc"
    ns["additional_config"] = {"rl_config": {"enabled": True}}
    ns["weight_transfer_config"] = {"backend": backend}
    extra = dict(_get(rollout, "engine_kwargs.rollbus", {}) or {})
    if "kv_cache_memory_bytes" in extra:  # vLLM: an explicit KV size replaces the utilisation fraction
        ns.pop("gpu_memory_utilization", None)
    ns.update(extra)
    return ns
