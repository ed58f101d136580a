"""`--tool-call-parser` names (vLLM's) and the parser classes behind them."""

from __future__ import annotations

from gateway.tool_parsers.base import ToolParser
from gateway.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from gateway.tool_parsers.glm45 import Glm45ToolParser
from gateway.tool_parsers.harmony import HarmonyToolParser
from gateway.tool_parsers.hermes import HermesToolParser
from gateway.tool_parsers.kimi_k2 import KimiK2ToolParser
from gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.pythonic import PythonicToolParser
from gateway.tool_parsers.qwen3_xml import Qwen3XmlToolParser

# vLLM's names; vLLM aliases qwen3_json (Qwen2.5 / QwQ / Qwen3 JSON calls) to hermes too.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,
    "qwen3_xml": Qwen3XmlToolParser,  # Qwen3-Coder's XML calls
    "qwen3_coder": Qwen3XmlToolParser,
    "llama3_json": Llama3JsonToolParser,  # Llama 3.x / 4 JSON calls
    "llama4_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,  # Llama 3.2 / 4, ToolACE: [f(x=1), g(y="a")]
    "deepseek_v3": DeepSeekV3ToolParser,  # DeepSeek-V3 / R1
    "deepseek_v31": DeepSeekV31ToolParser,  # DeepSeek-V3.1 / V3.2's chat format
    "kimi_k2": KimiK2ToolParser,  # Kimi-K2
    "glm45": Glm45ToolParser,  # GLM-4.5 / 4.6 / 4.7
    "mistral": MistralToolParser,  # Mistral / Ministral / Devstral: [TOOL_CALLS]
    "openai": HarmonyToolParser,  # gpt-oss's harmony format
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The class of a --tool-call-parser name; ValueError listing the available ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"invalid tool call parser: {name} (choose from {{ {','.join(TOOL_PARSERS)} }})") from None
