"""Requests the gateway must answer with a clean status (and `param`), for replay against any server.

`bad_input_cases(max_model_len=..., vocab_size=..., max_logprobs=...)` builds them for the served
model's limits; each case is (description, path, body, status, param). With `scale_out=True` the table
also covers POST /inference/v1/generate, for a server started with --enable-scale-out and
--enable-trace-replay. `body` is a dict/list (send as
JSON) or bytes (send raw, Content-Type: application/json). Cases with status 200 are combinations that
must work; they ask for at most 4 tokens. Bodies leave `model` out (the server's model), except the
unknown-model case.
"""

from __future__ import annotations

from typing import Any, NamedTuple

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"


class BadInput(NamedTuple):
    description: str
    path: str
    body: Any  # dict | list | str | bytes
    status: int
    param: str | None


def _msgs(text: str = "Hi") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def bad_input_cases(*, max_model_len: int, vocab_size: int, max_logprobs: int = 20,
                    max_n: int = 128, scale_out: bool = False, max_prompts: int | None = None,
                    max_prompt_tokens: int | None = None, max_body_bytes: int | None = None) -> list[BadInput]:
    """The max_* limits are the server's --max-prompts-per-request, --max-prompt-tokens-per-request and
    --max-request-body-bytes; each adds its cases when given (replay against a server started with them)."""
    L, V, M = max_model_len, vocab_size, max_logprobs
    cmp = {"prompt": "Hello", "max_tokens": 4}
    chat = {"messages": _msgs(), "max_tokens": 4}
    c: list[BadInput] = []

    def add(desc: str, path: str, body: Any, status: int = 400, param: str | None = None) -> None:
        c.append(BadInput(desc, path, body, status, param))

    # --- not JSON, or not an object
    add("malformed JSON", COMPLETIONS, b'{"prompt": "Hello", ')
    add("malformed JSON (chat)", CHAT, b'{"messages": [}')
    add("empty body", COMPLETIONS, b"")
    add("body is a JSON array", COMPLETIONS, [1, 2, 3])
    add("body is a JSON string", CHAT, "hello")
    add("body is a JSON number", CHAT, b"42")
    # --- wrong types
    add("max_tokens is a word", COMPLETIONS, {**cmp, "max_tokens": "ten"}, param="max_tokens")
    add("temperature is a word", COMPLETIONS, {**cmp, "temperature": "hot"}, param="temperature")
    add("n is a word", CHAT, {**chat, "n": "two"}, param="n")
    add("prompt is an object", COMPLETIONS, {"prompt": {"text": "Hi"}}, param="prompt")
    add("prompt missing", COMPLETIONS, {"max_tokens": 4}, param="prompt")
    add("messages is a string", CHAT, {"messages": "Hi"}, param="messages")
    add("messages missing", CHAT, {"max_tokens": 4}, param="messages")
    add("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, param="messages.0.role")
    add("content part of an unsupported type", CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        param="messages.0.content")
    add("stop is a number", COMPLETIONS, {**cmp, "stop": 3}, param="stop")
    add("stream_options is a string", CHAT, {**chat, "stream": True, "stream_options": "yes"},
        param="stream_options")
    # --- out of range
    add("negative max_tokens", COMPLETIONS, {**cmp, "max_tokens": -1}, param="max_tokens")
    add("zero max_tokens", CHAT, {**chat, "max_tokens": 0}, param="max_tokens")
    add("huge max_tokens", COMPLETIONS, {**cmp, "max_tokens": 10**9}, param="max_tokens")
    add("huge max_completion_tokens", CHAT, {"messages": _msgs(), "max_completion_tokens": 10**9},
        param="max_completion_tokens")
    add("prompt longer than the context", COMPLETIONS, {"prompt": [1] * (L + 1), "max_tokens": None},
        param="prompt")
    add("prompt exactly the context (no room to generate)", COMPLETIONS, {"prompt": [1] * L, "max_tokens": None},
        param="prompt")
    add("prompt + max_tokens beyond the context", COMPLETIONS, {"prompt": [1] * (L - 1), "max_tokens": 2},
        param="max_tokens")
    add("n too large", COMPLETIONS, {**cmp, "n": max_n + 1}, param="n")
    add("n zero", CHAT, {**chat, "n": 0}, param="n")
    add("token id = vocab size", COMPLETIONS, {"prompt": [1, V], "max_tokens": 4}, param="prompt")
    add("negative token id", COMPLETIONS, {"prompt": [-1, 5], "max_tokens": 4}, param="prompt")
    add("token id out of vocabulary in the 2nd prompt", COMPLETIONS,
        {"prompt": [[1, 2], [3, V + 10]], "max_tokens": 4}, param="prompt")
    add("empty token-id prompt", COMPLETIONS, {"prompt": [], "max_tokens": 4}, param="prompt")
    add("empty text prompt", COMPLETIONS, {"prompt": "", "max_tokens": 4, "add_special_tokens": False},
        param="prompt")
    add("empty prompt among several", COMPLETIONS, {"prompt": [[1, 2], []], "max_tokens": 4}, param="prompt")
    add("logprobs above the maximum", COMPLETIONS, {**cmp, "logprobs": M + 1}, param="logprobs")
    add("negative logprobs", COMPLETIONS, {**cmp, "logprobs": -1}, param="logprobs")
    add("top_logprobs above the maximum", CHAT, {**chat, "logprobs": True, "top_logprobs": M + 1},
        param="top_logprobs")
    add("top_logprobs without logprobs", CHAT, {**chat, "top_logprobs": 2}, param="top_logprobs")
    add("negative top_logprobs", CHAT, {**chat, "logprobs": True, "top_logprobs": -1}, param="top_logprobs")
    add("negative temperature", COMPLETIONS, {**cmp, "temperature": -0.5}, param="temperature")
    add("top_p zero", COMPLETIONS, {**cmp, "top_p": 0}, param="top_p")
    add("top_p above one", CHAT, {**chat, "top_p": 1.5}, param="top_p")
    add("top_k below -1", COMPLETIONS, {**cmp, "top_k": -2}, param="top_k")
    add("min_p above one", COMPLETIONS, {**cmp, "min_p": 2}, param="min_p")
    add("repetition_penalty zero", CHAT, {**chat, "repetition_penalty": 0}, param="repetition_penalty")
    add("presence_penalty above 2", CHAT, {**chat, "presence_penalty": 3}, param="presence_penalty")
    add("min_tokens above max_tokens", COMPLETIONS, {**cmp, "min_tokens": 10}, param="min_tokens")
    add("stop token id out of vocabulary", COMPLETIONS, {**cmp, "stop_token_ids": [V]}, param="stop_token_ids")
    add("seed beyond 64 bits", COMPLETIONS, {**cmp, "seed": 2**64}, param="seed")
    add("empty stop string", COMPLETIONS, {**cmp, "stop": [""]}, param="stop")
    add("stream_options without stream", COMPLETIONS, {**cmp, "stream_options": {"include_usage": True}},
        param="stream_options")
    add("suffix (unsupported)", COMPLETIONS, {**cmp, "suffix": "end"}, param="suffix")
    add("request chat_template (untrusted)", CHAT, {**chat, "chat_template": "{{ messages }}"},
        param="chat_template")
    # --- logprobs (issue 5)
    add("logprobs below -1", COMPLETIONS, {**cmp, "logprobs": -2}, param="logprobs")
    add("prompt_logprobs above the maximum", COMPLETIONS, {**cmp, "prompt_logprobs": M + 1}, param="prompt_logprobs")
    add("prompt_logprobs -1 (whole vocabulary) above the maximum", COMPLETIONS, {**cmp, "prompt_logprobs": -1},
        param="prompt_logprobs")
    add("prompt_logprobs with stream", COMPLETIONS, {**cmp, "prompt_logprobs": 1, "stream": True},
        param="prompt_logprobs")
    add("prompt_logprobs with stream (chat)", CHAT, {**chat, "prompt_logprobs": -1, "stream": True},
        param="prompt_logprobs")
    add("prompt_logprobs below -1 (chat)", CHAT, {**chat, "prompt_logprobs": -3}, param="prompt_logprobs")
    add("top_logprobs -1 (whole vocabulary) above the maximum", CHAT, {**chat, "logprobs": True, "top_logprobs": -1},
        param="top_logprobs")
    add("max_tokens 0 without echo", COMPLETIONS, {**cmp, "max_tokens": 0}, param="max_tokens")
    # --- routed experts (issue 5): the start must lie within [0, prompt length]
    rx = "routed_experts_prompt_start"
    add("routed_experts_prompt_start beyond the prompt", COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2, rx: 4},
        param=rx)
    add("negative routed_experts_prompt_start (chat)", CHAT, {**chat, rx: -1}, param=rx)
    add("routed_experts_prompt_start is a word", COMPLETIONS, {**cmp, rx: "two"}, param=rx)
    add("routed_experts_prompt_start is fractional", CHAT, {**chat, rx: 1.5}, param=rx)
    # --- absurd and non-finite numbers (issue 11): 400 before anything is allocated
    add("temperature 1e999 (parses to inf)", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 4, "temperature": 1e999}',
        param="temperature")
    add("temperature Infinity (chat)", CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": Infinity}',
        param="temperature")
    add("temperature above 2 (vLLM's range)", CHAT, {**chat, "temperature": 2.5}, param="temperature")
    add("repetition_penalty 1e999", COMPLETIONS,
        b'{"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1e999}', param="repetition_penalty")
    add("top_p NaN", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 4, "top_p": NaN}', param="top_p")
    add("presence_penalty -1e999", CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "presence_penalty": -1e999}',
        param="presence_penalty")
    add("n = 10**9", COMPLETIONS, {**cmp, "n": 10**9}, param="n")
    add("best_of = 10**9", COMPLETIONS, {**cmp, "best_of": 10**9}, param="best_of")
    add("max_tokens = 10**30", COMPLETIONS, {**cmp, "max_tokens": 10**30}, param="max_tokens")
    add("logprobs = 10**12", COMPLETIONS, {**cmp, "logprobs": 10**12}, param="logprobs")
    add("top_logprobs = 10**12", CHAT, {**chat, "logprobs": True, "top_logprobs": 10**12}, param="top_logprobs")
    # --- request limits (issue 11)
    if max_prompts is not None:
        add("more prompts than --max-prompts-per-request", COMPLETIONS,
            {"prompt": [[1, 2]] * (max_prompts + 1), "max_tokens": 1}, param="prompt")
        add("more text prompts than --max-prompts-per-request", COMPLETIONS,
            {"prompt": ["a"] * (max_prompts + 1), "max_tokens": 1}, param="prompt")
        add("exactly --max-prompts-per-request prompts", COMPLETIONS,
            {"prompt": [[1, 2]] * min(max_prompts, 4), "max_tokens": 1}, status=200)
    if max_prompt_tokens is not None:
        per = min(L - 2, max_prompt_tokens + 1)
        count = max_prompt_tokens // per + 1
        if max_prompts is None or count <= max_prompts:
            add("more prompt tokens than --max-prompt-tokens-per-request", COMPLETIONS,
                {"prompt": [[1] * per] * count, "max_tokens": 1}, param="prompt")
    if max_body_bytes is not None:
        add("body above --max-request-body-bytes", COMPLETIONS,
            b'{"prompt": "' + b"a" * max_body_bytes + b'", "max_tokens": 1}', status=413)
        add("body above --max-request-body-bytes (chat)", CHAT,
            b'{"messages": [{"role": "user", "content": "' + b"a" * max_body_bytes + b'"}]}', status=413)
    # --- unknown model
    add("unknown model", COMPLETIONS, {**cmp, "model": "no-such-model"}, status=404, param="model")
    add("unknown model (chat)", CHAT, {**chat, "model": "no-such-model"}, status=404, param="model")
    # --- combinations that must work
    add("stream + n=2 + logprobs", COMPLETIONS, {**cmp, "stream": True, "n": 2, "logprobs": 2}, status=200)
    add("stream + include_usage + several prompts + n=2", COMPLETIONS,
        {"prompt": ["Hello", "Bye"], "max_tokens": 3, "n": 2, "stream": True,
         "stream_options": {"include_usage": True}}, status=200)
    add("chat stream + n=2 + top_logprobs", CHAT,
        {**chat, "stream": True, "n": 2, "logprobs": True, "top_logprobs": 2}, status=200)
    add("logprobs exactly the maximum", COMPLETIONS, {**cmp, "logprobs": M}, status=200)
    add("chat top_logprobs exactly the maximum", CHAT, {**chat, "logprobs": True, "top_logprobs": M}, status=200)
    add("n=3 with a seed", CHAT, {**chat, "n": 3, "seed": 7, "temperature": 1.0}, status=200)
    add("several token-id prompts", COMPLETIONS, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3}, status=200)
    add("unknown extra fields are ignored", CHAT, {**chat, "best_of": None, "frobnicate": 1}, status=200)
    add("text content parts", CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2},
        status=200)
    add("echo + logprobs + prompt_logprobs", COMPLETIONS, {**cmp, "echo": True, "logprobs": 2, "prompt_logprobs": M},
        status=200)
    add("echo + max_tokens 0 (score the prompt)", COMPLETIONS, {**cmp, "echo": True, "max_tokens": 0, "logprobs": 1},
        status=200)
    add("stream + echo + logprobs", COMPLETIONS, {**cmp, "echo": True, "logprobs": 1, "stream": True}, status=200)
    add("prompt_logprobs 0 with stream (vLLM allows it)", COMPLETIONS, {**cmp, "prompt_logprobs": 0, "stream": True},
        status=200)
    add("chat prompt_logprobs + return_sampling_mass", CHAT,
        {**chat, "prompt_logprobs": 2, "return_sampling_mass": True, "top_p": 0.9}, status=200)
    add("routed_experts_prompt_start = the prompt length", COMPLETIONS,
        {"prompt": [1, 2, 3], "max_tokens": 2, rx: 3}, status=200)
    # vLLM's logits processors of a request (docs/openai-api.md)
    add("logit_bias, allowed_token_ids and bad_words", CHAT, {**chat, "logit_bias": {"5": 200, "6": -3.5},
                                                             "allowed_token_ids": [5, 6, 7], "bad_words": ["Hi"]},
        status=200)
    add("logit_bias of a token outside the vocabulary", COMPLETIONS, {**cmp, "logit_bias": {str(V): 1.0}},
        param="logit_bias")
    add("logit_bias key that is no integer", CHAT, {**chat, "logit_bias": {"abc": 1.0}}, param="logit_bias")
    add("allowed_token_ids empty", COMPLETIONS, {**cmp, "allowed_token_ids": []}, param="allowed_token_ids")
    add("allowed_token_ids outside the vocabulary", CHAT, {**chat, "allowed_token_ids": [1, V]},
        param="allowed_token_ids")
    add("bad_words with an empty word", COMPLETIONS, {**cmp, "bad_words": ["ok", ""]}, param="bad_words")
    # vLLM: a priority other than 0 needs --scheduling-policy priority (these servers run fcfs)
    add("priority without the priority policy", CHAT, {**chat, "priority": 1}, param="priority")
    add("priority without the priority policy (completions)", COMPLETIONS, {**cmp, "priority": -3}, param="priority")
    c.extend(unsupported_field_cases())
    if scale_out:
        c.extend(_generate_cases(L, V, M))
        c.extend(unsupported_generate_cases())
    return c


# vLLM v0.33 fields rollbus does not implement, each with a value that asks for something (-> 400 naming
# the field) and, where the field has one, a value that asks for nothing (-> 200).
ASKING_SAMPLING: dict[str, Any] = {
    "use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "logprob_token_ids": [5],
    "thinking_token_budget": 10, "repetition_detection": {"max_pattern_size": 3},
    "kv_transfer_params": {"do_remote_prefill": True}, "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"k": 1}, "best_of": 3,
}
ASKING_COMPLETION: dict[str, Any] = {**ASKING_SAMPLING, "suffix": "end", "prompt_embeds": "AAAA"}
ASKING_CHAT: dict[str, Any] = {
    **ASKING_SAMPLING, "echo": True, "return_prompt_text": True,
    "media_io_kwargs": {"image": {"x": 1}}, "mm_processor_kwargs": {"x": 1},
}
NEUTRAL: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": None, "logit_bias": {},
    "allowed_token_ids": None, "bad_words": [], "logprob_token_ids": None, "structured_outputs": {"regex": None},
    "response_format": {"type": "text"}, "priority": 0, "best_of": 1, "guided_json": None,
    "kv_transfer_params": None, "vllm_xargs": {}, "echo": False, "include_reasoning": True,
}
# Fields that change nothing in the output: accepted with any valid value.
HARMLESS_CHAT: dict[str, Any] = {
    "user": "u-1", "metadata": {"run": "7"}, "request_id": "abc", "session_id": "s-1", "cache_salt": "salty",
    "parallel_tool_calls": False, "stream_interval": 4, "return_token_offsets": True, "mm_payload": "none",
    "spaces_between_special_tokens": False, "skip_special_tokens": None,
    "include_reasoning": False,  # without --reasoning-parser there is no reasoning to leave out
}
ASKING_ENGINE_SAMPLING: dict[str, Any] = {
    "watermarking": True, "prompt_logprob_token_ids": [5], "prompt_logprob_start": 1, "logprob_token_ids": [5],
    "extra_args": {"k": 1}, "skip_reading_prefix_cache": True, "thinking_token_budget": 3,
    "repetition_detection": {"max_pattern_size": 2},
}
ASKING_GENERATE: dict[str, Any] = {
    "features": {"mm_hashes": {}}, "content_parts": [{"type": "image_url"}], "kv_transfer_params": {"x": 1},
    "ec_transfer_params": {"x": 1}, "output_mode": "text",
}


def unsupported_field_cases() -> list[BadInput]:
    cmp = {"prompt": "Hello", "max_tokens": 2}
    chat = {"messages": _msgs(), "max_tokens": 2}
    c = [BadInput(f"unsupported {k} (completions)", COMPLETIONS, {**cmp, k: v}, 400, k)
         for k, v in ASKING_COMPLETION.items()]
    c += [BadInput(f"unsupported {k} (chat)", CHAT, {**chat, k: v}, 400, k) for k, v in ASKING_CHAT.items()]
    # one request each carrying every neutral value (a real engine replays these: keep them few)
    chat_only = ("echo", "include_reasoning")
    c.append(BadInput("refusable fields asking for nothing (completions)", COMPLETIONS,
                      {**cmp, **{k: v for k, v in NEUTRAL.items() if k not in chat_only}}, 200, None))
    c.append(BadInput("refusable fields asking for nothing (chat)", CHAT, {**chat, **NEUTRAL}, 200, None))
    c.append(BadInput("fields that change no output (chat)", CHAT, {**chat, **HARMLESS_CHAT}, 200, None))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for desc, extra, status, param in (
            ("tools with the default tool_choice (auto)", {"tools": [tool]}, 400, "tool_choice"),
            ("tool_choice auto", {"tools": [tool], "tool_choice": "auto"}, 400, "tool_choice"),
            # forced tool calls (docs/structured-outputs.md): served without a tool parser, as in vLLM
            ("tool_choice required", {"tools": [tool], "tool_choice": "required"}, 200, None),
            ("named tool_choice", {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
             200, None),
            ("named tool_choice not in tools",
             {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
            ("structural tags", {"structured_outputs": {"structural_tag": "{}"}}, 400,
             "structured_outputs.structural_tag"),
            ("response_format structural_tag", {"response_format": {"type": "structural_tag", "format": {}}}, 400,
             "response_format"),
            ("guided_decoding_backend xgrammar", {"guided_json": {"type": "object"},
                                                  "guided_decoding_backend": "xgrammar"}, 400,
             "guided_decoding_backend"),
            ("a regex that does not compile", {"guided_regex": "(ab"}, 400, "guided_regex"),
            ("tool_choice without tools", {"tool_choice": "required"}, 400, "tool_choice"),
            ("named tool_choice of an undefined function",
             {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
            ("tool parameters not a JSON Schema",
             {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
              "tool_choice": "none"}, 400, "tools.0.function.parameters"),
            ("tool parameters with a $schema that is no string",
             {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}],
              "tool_choice": "none"}, 400, "tools.0.function.parameters"),
            ("empty tools", {"tools": []}, 400, "tools"),
            ("tools rendered, tool_choice none", {"tools": [tool], "tool_choice": "none"}, 200, None),
            ("truncation_side right", {"truncate_prompt_tokens": 3, "truncation_side": "right"}, 200, None),
            ("truncation_side sideways", {"truncation_side": "up"}, 400, "truncation_side"),
            ("cache_salt empty", {"cache_salt": ""}, 400, "cache_salt"),
            ("documents and reasoning_effort go to the template",
             {"documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"}, 200, None)):
        c.append(BadInput(desc, CHAT, {**chat, **extra}, status, param))
    return c


def unsupported_generate_cases() -> list[BadInput]:
    base = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    c = [BadInput(f"generate: unsupported sampling_params.{k}", GENERATE,
                  {**base, "sampling_params": {"max_tokens": 2, k: v}}, 400, f"sampling_params.{k}")
         for k, v in ASKING_ENGINE_SAMPLING.items()]
    c += [BadInput(f"generate: unsupported {k}", GENERATE, {**base, k: v}, 400, k) for k, v in ASKING_GENERATE.items()]
    c.append(BadInput("generate: logit_bias, allowed_token_ids, bad_words", GENERATE,
                      {**base, "sampling_params": {"max_tokens": 2, "logit_bias": {"3": -100},
                                                   "allowed_token_ids": [3, 4], "bad_words": ["x"]}}, 200, None))
    c.append(BadInput("generate: priority without the priority policy", GENERATE, {**base, "priority": 2}, 400,
                      "priority"))
    c.append(BadInput("generate: allowed_token_ids negative", GENERATE,
                      {**base, "sampling_params": {"max_tokens": 2, "allowed_token_ids": [-1]}}, 400,
                      "sampling_params.allowed_token_ids"))
    c.append(BadInput("generate: what TRL and SkyRL send (output_kind, cache_salt, neutral values)", GENERATE,
                      {**base, "cache_salt": "v3-policy", "priority": 0, "features": None,
                       "sampling_params": {"max_tokens": 2, "output_kind": 2, "logprobs": 0, "structured_outputs": None,
                                           "skip_reading_prefix_cache": False, "detokenize": True}}, 200, None))
    return c


def _generate_cases(L: int, V: int, M: int) -> list[BadInput]:
    def g(desc: str, body: Any, status: int = 400, param: str | None = None) -> BadInput:
        return BadInput("generate: " + desc, GENERATE, body, status, param)

    def sp(**kw: Any) -> dict[str, Any]:
        return {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, **kw}}

    return [
        g("malformed JSON", b'{"token_ids": [1, '),
        g("token_ids missing", {"sampling_params": {"max_tokens": 2}}, param="token_ids"),
        g("empty token_ids", {"token_ids": []}, param="token_ids"),
        g("negative token id", {"token_ids": [-1, 5]}, param="token_ids"),
        g("token id = vocab size", {"token_ids": [1, V]}, param="token_ids"),
        g("token_ids is a string", {"token_ids": "hello"}, param="token_ids"),
        g("temperature is a word", sp(temperature="hot"), param="sampling_params.temperature"),
        g("prompt longer than the context", {"token_ids": [1] * (L + 1)}, param="token_ids"),
        g("max_tokens beyond the context", sp(max_tokens=L), param="sampling_params.max_tokens"),
        g("logprobs above the maximum", sp(logprobs=M + 1), param="sampling_params.logprobs"),
        g("logprobs below -1", sp(logprobs=-2), param="sampling_params.logprobs"),
        g("prompt_logprobs above the maximum", sp(prompt_logprobs=M + 1), param="sampling_params.prompt_logprobs"),
        g("prompt_logprobs with stream", {**sp(prompt_logprobs=1), "stream": True},
          param="sampling_params.prompt_logprobs"),
        g("stop token id out of vocabulary", sp(stop_token_ids=[V]), param="sampling_params.stop_token_ids"),
        g("n above max_num_seqs", sp(n=100000), param="sampling_params.n"),
        g("trace with n > 1", sp(n=2, trace_decode_token_ids=[5, 6]), param="sampling_params.trace_decode_token_ids"),
        g("empty trace", sp(trace_decode_token_ids=[]), param="sampling_params.trace_decode_token_ids"),
        g("trace token out of vocabulary", sp(trace_decode_token_ids=[5, V]),
          param="sampling_params.trace_decode_token_ids"),
        g("negative trace token", sp(trace_decode_token_ids=[-3]), param="sampling_params.trace_decode_token_ids"),
        g("trace with prompt_logprobs", sp(trace_decode_token_ids=[5], prompt_logprobs=1),
          param="sampling_params.trace_decode_token_ids"),
        g("routed_experts_prompt_start beyond the prompt", sp(routed_experts_prompt_start=4),
          param="sampling_params.routed_experts_prompt_start"),
        g("negative routed_experts_prompt_start", sp(routed_experts_prompt_start=-1),
          param="sampling_params.routed_experts_prompt_start"),
        g("routed_experts_prompt_start is a string", sp(routed_experts_prompt_start="1"),
          param="sampling_params.routed_experts_prompt_start"),
        g("stream_options without stream", {**sp(), "stream_options": {"include_usage": True}},
          param="stream_options"),
        g("unknown model", {**sp(), "model": "no-such-model"}, status=404, param="model"),
        g("logprobs + prompt_logprobs + mass", sp(logprobs=2, prompt_logprobs=M, return_sampling_mass=True,
                                                 top_k=5), status=200),
        g("trace replay with logprobs", sp(trace_decode_token_ids=[5, 6, 7, 8], logprobs=1), status=200),
        g("stream + n=2 + logprobs", {**sp(n=2, logprobs=1), "stream": True}, status=200),
        g("routed_experts_prompt_start = the prompt length", sp(routed_experts_prompt_start=3), status=200),
    ]
