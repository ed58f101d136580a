"""`vllm serve` flags rollbus has no option of its own for: accepted as no-ops (a note in the log), accepted
only with the values rollbus implements, or refused by name; and the help formatter that shows them.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.argv import Switch
from engine.vllm_flags import VLLM_SERVE_FLAGS, VLLM_VERSION


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _format_action_invocation(self, action):
        if isinstance(action, Switch) or (isinstance(action, VllmFlag) and action.nargs == 0):
            return ", ".join(action.visible)
        if isinstance(action, VllmFlag):
            return ", ".join(f"{o} VALUE" for o in action.visible)
        return super()._format_action_invocation(action)

    def _get_help_string(self, action):
        if action.default in (None, False, [], "") or isinstance(action, VllmFlag):
            return action.help
        return super()._get_help_string(action)


class VllmFlag(argparse.Action):
    """A vLLM flag rollbus has no option of its own for: records (option used, value) for
    engine.config.config_from_args to note or refuse."""

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
    "ray_workers_use_nsight": "rollbus does not profile its Ray worker actors with nsight",
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


def vllm_dest(dest: str) -> str:
    return "vllm__" + dest


def add_vllm_only_args(p: argparse.ArgumentParser) -> None:
    """Every other `vllm serve` flag: no-ops (shown, with their note), refusals with a reason of their own
    (shown), and the rest (hidden: refused by name; docs/serving.md lists them)."""
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
            action: Any = VllmSwitch
        else:
            action = VllmFlag
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
        target.add_argument(*options, action=action, nargs=nargs, dest=vllm_dest(dest), default=None,
                            help=text, **extra)
        known |= set(options)


class VllmSwitch(VllmFlag):
    """A vLLM switch: records "true" for its own name (or a short form), "false" for the inverse forms."""

    def __init__(self, option_strings, dest, nargs=0, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        own = "--" + self.dest.removeprefix("vllm__").replace("_", "-")
        on = option_string == own or not option_string.startswith("--")
        super().__call__(parser, namespace, "true" if on else "false", option_string)


def refusals_and_notes(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
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
