"""Request bodies of /v1/completions, /v1/chat/completions and /inference/v1/generate, as vLLM accepts them.

Field names, types and defaults are vLLM's (OpenAI's fields plus vLLM's sampling extras), so clients
port unchanged. Unknown fields are ignored with a log line, as vLLM does. Checks that span several
fields raise ParamError (naming the field), which the gateway reports as a 400 with `param` set.

Every field of vLLM v0.33's schemas is declared here with vLLM's type, so none is dropped unread: a
field rollbus does not implement is refused (400 naming it) when its value asks for something, through
the `Refuse` tables of refused.py (docs/openai-api.md lists them); a value that asks for nothing (the
default, null, an empty list) is accepted. Structured outputs (`structured_outputs`, `response_format`, and
the `guided_*` fields vLLM v0.33 removed, accepted here as aliases) become one constraint in
gateway/structured.py.

One module per body: completions.py, chat.py, generate.py; their sampling fields and checks (shared by
completions and chat, and generate's sampling_params) are sampling.py, what every body shares (the base
model, stream_options, schema keywords) fields.py, the refused fields refused.py. This package exports the
bodies and the refusal tables.
"""

from gateway.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionDefinition, TextPart, Tool
from gateway.protocol.completions import CompletionRequest, Prompt
from gateway.protocol.fields import OpenAIModel, StreamOptions
from gateway.protocol.generate import GenerateRequest
from gateway.protocol.refused import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_ENGINE_SAMPLING,
    REFUSED_GENERATE,
    REFUSED_SAMPLING,
    Refuse,
    refuse_unsupported,
)
from gateway.protocol.sampling import GenerateSamplingParams, check_prompt_logprobs, logit_bias_ids

__all__ = [
    "REFUSED_CHAT", "REFUSED_COMPLETION", "REFUSED_ENGINE_SAMPLING", "REFUSED_GENERATE", "REFUSED_SAMPLING",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "FunctionDefinition", "GenerateRequest",
    "GenerateSamplingParams", "OpenAIModel", "Prompt", "Refuse", "StreamOptions", "TextPart", "Tool",
    "check_prompt_logprobs", "logit_bias_ids", "refuse_unsupported",
]
