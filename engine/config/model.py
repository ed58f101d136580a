"""What is served and how its text is read and written: the checkpoint, its dtype and limits, the chat
template, tool-call and reasoning parsers, default sampling parameters, structured outputs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from engine import flag_owners
from engine.argv import Switch, human_int_or_auto, json_object_type
from engine.structured_outputs import StructuredOutputsConfig, parse_structured_outputs_config

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "safetensors", "dummy", "gguf")


@dataclass(slots=True)
class ModelConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    served_model_name: list[str] = field(default_factory=list)
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (random weights, for a first weight sync)
    use_tqdm_on_load: bool = True
    chat_template: str | None = None  # a file path or the template itself
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON object
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls out of the output
    tool_call_parser: str | None = None  # gateway.tool_parsers names (vLLM's)
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None  # gateway.reasoning_parsers names (vLLM's); "" / "none": off
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    override_generation_config: dict[str, Any] = field(default_factory=dict)  # JSON object
    max_logprobs: int = 20
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    @property
    def model_name(self) -> str:
        """The name the API reports: the first --served-model-name, else the model argument."""
        if self.served_model_name:
            return self.served_model_name[0]
        return self.model or DEFAULT_MODEL_NAME


def json_dict(flag: str):
    """A JSON object flag whose keys the reader judges: its dict ({} when the flag is absent)."""
    def parse(text: str | None) -> dict[str, Any]:
        if text is None:
            return {}
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError(f"{flag} must be a JSON object")
        return obj
    return parse


def _so_text(so: StructuredOutputsConfig) -> str:
    return json.dumps({"backend": so.backend, "disable_any_whitespace": so.disable_any_whitespace,
                       "disable_additional_properties": so.disable_additional_properties})


JSON_FLAGS = {
    "default_chat_template_kwargs": (json_dict("--default-chat-template-kwargs"), json.dumps),
    "override_generation_config": (json_dict("--override-generation-config"), json.dumps),
    "structured_outputs_config": (parse_structured_outputs_config, _so_text),
}


def add_args(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", dest="model_option", default=None,
                   help="The model, as an option (vLLM's spelling for config files); the positional wins.")
    g.add_argument("--config", default=None,
                   help="YAML file of flags, as vLLM: `max-num-seqs: 64` or `max_num_seqs: 64`; true adds the "
                        "flag, false its --no- form; lists and objects as the flag takes them. Flags on the "
                        "command line override the file.")
    g.add_argument("--served-model-name", nargs="+", default=[],
                   help="Model name(s) the API answers to; the first is reported in responses. "
                        "Default: the model argument.")
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
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: the "
                        "whole vocabulary (a request's -1 asks for the whole vocabulary).")
    g = p.add_argument_group("chat, tools and generation defaults")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions instead of the tokenizer's: a file path, or "
                        "the Jinja template itself (vLLM's rule: a value that cannot be opened and contains "
                        "one of '{', '}' or a newline is the template).")
    g.add_argument("--trust-request-chat-template", action=Switch, default=d.trust_request_chat_template,
                   help="Allow a request's own chat_template field (otherwise such a request is a 400).")
    g.add_argument("--default-chat-template-kwargs", type=json_object_type("--default-chat-template-kwargs"),
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
    g.add_argument("--generation-config", default=d.generation_config,
                   help="Default sampling parameters: 'auto' takes the model folder's generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition/presence/frequency penalty, "
                        "max_new_tokens), 'vllm' uses vLLM's neutral defaults, a folder takes its "
                        "generation_config.json. A request's own values always win.")
    g.add_argument("--override-generation-config", type=json_object_type("--override-generation-config"),
                   default=None, help='JSON object applied over --generation-config, e.g. \'{"temperature": 0.5}\'.')
    g.add_argument("--structured-outputs-config", type=json_object_type("--structured-outputs-config"), default=None,
                   help='JSON object (vLLM\'s StructuredOutputsConfig; docs/structured-outputs.md). backend: "auto" or '
                        '"guidance" (llguidance, the only engine here); disable_any_whitespace (no whitespace '
                        "between JSON tokens; default false); disable_additional_properties (objects without "
                        "additionalProperties get false; default false).")


def _check_load_format(cfg: ModelConfig) -> None:
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


def _check_parsers(cfg: ModelConfig, tokens_only: bool) -> None:
    """vLLM's start-up checks of --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser."""
    if cfg.enable_auto_tool_choice and not cfg.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if tokens_only and (cfg.tool_call_parser or cfg.reasoning_parser):
        raise ValueError("--tool-call-parser and --reasoning-parser read text, and --tokens-only loads no tokenizer")
    if cfg.tool_call_parser:
        flag_owners.check("tool_call_parser", cfg.tool_call_parser)
    if cfg.reasoning_parser:
        flag_owners.check("reasoning_parser", cfg.reasoning_parser)
    harmony = (cfg.tool_call_parser == "openai", cfg.reasoning_parser == "openai_gptoss")
    if cfg.tool_call_parser and cfg.reasoning_parser and harmony[0] != harmony[1]:  # vLLM's HarmonyParser refuses it
        raise ValueError("--tool-call-parser openai and --reasoning-parser openai_gptoss (gpt-oss's harmony format) "
                         "go together: neither reads another parser's format")


def check_model_config(cfg: ModelConfig, tokens_only: bool) -> None:
    """Start-up checks of the model flags; ValueError (or OSError) names the flag."""
    from engine.generation_defaults import check_generation_config

    _check_load_format(cfg)
    check_generation_config(cfg.generation_config)
    _check_parsers(cfg, tokens_only)
    if cfg.chat_template is not None:
        flag_owners.check("chat_template", cfg.chat_template)
