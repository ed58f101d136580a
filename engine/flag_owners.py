"""Flag values that only a layer above engine can judge: the gateway's tool-call and reasoning parsers and its
chat templates, the workers' extension classes. engine/config/ imports nothing above engine (the import
floors, docs/architecture.md), so it asks the owner this table names, by module path, when the flag is given
(and `rollbus serve --help` lists the parser names the same way): the owning module is imported then, by the
process that parses the flags, and never by engine's modules themselves.
"""

from __future__ import annotations

import importlib
from typing import Any

# EngineConfig field -> "module:function" that raises ValueError (or OSError) for a value it refuses
CHECKS = {
    "tool_call_parser": "gateway.tool_parsers:tool_parser_class",
    "reasoning_parser": "gateway.reasoning_parsers:reasoning_parser_class",
    "chat_template": "gateway.tokenizer:resolve_chat_template",
    "worker_extension_cls": "workers.extension:check_qualname",
}
# EngineConfig field -> "module:REGISTRY", a mapping whose keys are the values the flag accepts
CHOICES = {
    "tool_call_parser": "gateway.tool_parsers:TOOL_PARSERS",
    "reasoning_parser": "gateway.reasoning_parsers:REASONING_PARSERS",
}


def _owner(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def check(field: str, value: Any) -> None:
    """Ask the flag's owner whether it takes `value` (raises what the owner raises)."""
    _owner(CHECKS[field])(value)


def choices(field: str) -> list[str]:
    """The values the flag's owner accepts."""
    return list(_owner(CHOICES[field]))
