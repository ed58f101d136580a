"""vLLM's tokenizer and render routes, and the `vllm_config` that /server_info reports.

    POST /tokenize        {prompt} or {messages} -> {count, max_model_len, tokens, token_strs}
    POST /detokenize      {tokens} -> {prompt}
    POST /v1/chat/completions/render   a chat request -> the /inference/v1/generate request it becomes
    POST /v1/completions/render        a completion request -> one generate request per prompt

The render routes are vLLM's scale-out endpoints: 403 unless --enable-scale-out (or --tokens-only),
as vLLM. Their output posted unchanged to /inference/v1/generate generates what the chat or completion
request would have. Request bodies are validated with the same models (and refusals) as generation.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from bus.sampling_params import ParamError, SamplingParams
from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig, async_scheduling_on
from engine.config.cache import in_batch_sharing_on, prefix_caching_on
from gateway.errors import bad_request, model_not_found
from gateway.protocol.chat import ChatCompletionRequest, Tool
from gateway.protocol.completions import CompletionRequest
from gateway.responses import JSONResponse
from gateway.serving import ModelInfo, ServingContext
from gateway.serving_chat import prepare as prepare_chat
from gateway.serving_chat import render_prompt
from gateway.serving_completions import prepare as prepare_completion
from gateway.serving_generate import check_enabled

T = TypeVar("T", CompletionRequest, ChatCompletionRequest)
RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")
_I64_MAX = 2**63 - 1
# vLLM's RequestOutputKind
DELTA, FINAL_ONLY = 1, 2


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request with this request's rendering fields (vLLM's to_chat_completion_request); the
        tools are only rendered, so tool_choice is "none"."""
        data = self.model_dump(include={"model", "messages", "add_generation_prompt", "continue_final_message",
                                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                                        "media_io_kwargs", "mm_processor_kwargs"}, exclude_none=True)
        if self.tools:
            data["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            data["tool_choice"] = "none"
        return ChatCompletionRequest.model_validate(data)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"minimum": 0, "maximum": _I64_MAX}})


def _need_tokenizer(ctx: ServingContext, what: str) -> None:
    if ctx.tokenizer is None:
        raise bad_request(f"this server runs with --tokens-only and loads no tokenizer, so it cannot {what}")


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model and model not in ctx.model.names and (ctx.lora is None or ctx.lora.ref(model) is None):
        raise model_not_found(model)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise bad_request(f"Invalid JSON body: {e}") from None


def sampling_params_json(params: SamplingParams, n: int, seed: int | None, stream: bool) -> dict[str, Any]:
    """Our SamplingParams under vLLM's field names, as /inference/v1/generate takes them back."""
    d = msgspec.structs.asdict(params)
    if params.structured_outputs is not None:  # vLLM's StructuredOutputsParams as JSON (json as its text)
        d["structured_outputs"] = msgspec.structs.asdict(params.structured_outputs)
    d.pop("cache_salt")  # request fields in vLLM (GenerateRequest.cache_salt, .priority), not sampling parameters
    d.pop("priority")
    d.pop("bad_words_token_ids")  # generate tokenizes bad_words again, as vLLM's engine does
    d.update(n=n, seed=seed, output_kind=DELTA if stream else FINAL_ONLY)
    for beyond_vllm in ("return_sampling_mass", "trace_decode_token_ids"):  # only when asked for
        if not d[beyond_vllm]:
            del d[beyond_vllm]
    return d


def _generate_request(request_id: str, ids: list[int], params: dict[str, Any], body: Any,
                      parse_context: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's GenerateRequest JSON (scale_out/token_in_token_out/protocol.py), every field present."""
    out: dict[str, Any] = {
        "request_id": request_id, "token_ids": ids, "token_offsets": None, "features": None, "content_parts": None,
        "sampling_params": params, "model": body.model, "reasoning_ended": None, "reasoning_parser_kwargs": None,
        "return_token_ids": body.return_token_ids, "output_mode": "tokens", "stream": bool(body.stream),
        "stream_options": body.stream_options.model_dump() if body.stream and body.stream_options else None,
        "cache_salt": body.cache_salt, "priority": body.priority, "kv_transfer_params": None,
        "ec_transfer_params": None}
    if parse_context is not None:
        out["parse_context"] = parse_context
    return out


def _refuse_offsets(body: Any) -> None:
    if body.return_token_offsets:
        raise ParamError("return_token_offsets", "`return_token_offsets` is not supported by rollbus yet.")


def add_vllm_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        raw = await _json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate(raw)
        _check_model(ctx, body.model)
        _need_tokenizer(ctx, "tokenize")
        if isinstance(body, TokenizeChatRequest):
            req = body.to_chat_request()
            req.check()  # the same refusals as the chat route (media kwargs, ...); render_prompt: chat_template
            (ids,) = await ctx.encode_many([render_prompt(ctx, req)], body.add_special_tokens,
                                           budget=ctx.cfg.gateway.max_prompt_tokens_per_request, param="messages")
        else:
            (ids,) = await ctx.encode_many([body.prompt], body.add_special_tokens,
                                           budget=ctx.cfg.gateway.max_prompt_tokens_per_request)
        strs = [ctx.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = DetokenizeRequest.model_validate(await _json(request))
        _check_model(ctx, body.model)
        _need_tokenizer(ctx, "detokenize")
        for t in body.tokens:
            if not 0 <= t < ctx.model.vocab_size:
                raise bad_request(f"Token id {t} is out of vocabulary", "tokens")
        # vLLM decodes the prompt with special tokens kept
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def render_body(request: Request, schema: type[T]) -> T:
        """What both render routes check first: scale-out on, a valid body for our model, no offsets."""
        check_enabled(ctx)
        body = schema.model_validate(await _json(request))
        _check_model(ctx, body.model)
        _refuse_offsets(body)
        return body

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> JSONResponse:
        body = await render_body(request, ChatCompletionRequest)
        base = request.headers.get("x-request-id") or body.request_id or os.urandom(16).hex()
        request_id = f"chatcmpl-{base}"
        states = await prepare_chat(ctx, body, request_id)
        first = states[0]
        params = sampling_params_json(first.params, len(states), body.seed, bool(body.stream))
        context = {"tools": body.template_tools(), "tool_choice": body.tool_choice,
                   "parallel_tool_calls": body.parallel_tool_calls, "include_reasoning": body.include_reasoning,
                   "chat_template_kwargs": body.template_kwargs(),
                   "history_tool_call_cnt": sum(len(m.tool_calls or []) for m in body.messages)}
        return JSONResponse(_generate_request(request_id, first.prompt_ids, params, body, context))

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> JSONResponse:
        body = await render_body(request, CompletionRequest)
        base = f"cmpl-{request.headers.get('x-request-id') or body.request_id or os.urandom(16).hex()}"
        encoded, states = await prepare_completion(ctx, body, base)
        out = []
        for pi, ids in enumerate(encoded):
            first = states[pi * body.n]
            params = sampling_params_json(first.params, body.n, body.seed, bool(body.stream))
            out.append(_generate_request(base if len(encoded) == 1 else f"{base}-{pi}", ids, params, body))
        return JSONResponse(out)


# --- /server_info's vllm_config -------------------------------------------------------------------


def _dtype_name(workers: dict[str, dict[str, Any]], fallback: str) -> str:
    """vLLM reports the resolved torch dtype ("torch.float32"); the workers know what they serve."""
    for info in workers.values():
        d = info.get("dtype")
        if d:
            d = str(d)
            return d if d.startswith("torch.") else f"torch.{d}"
    return fallback


def vllm_config(cfg: EngineConfig, model: ModelInfo, workers: dict[str, dict[str, Any]],
                weight_transfer: dict[str, Any] | None) -> dict[str, Any]:
    """The parts of vLLM's VllmConfig JSON (GET /server_info?config_format=json) that mean something
    here, under vLLM's section and key names: what TRL's and SkyRL's clients read (model, dtype,
    max_model_len, parallel sizes, weight_transfer_config) and the serving limits."""
    tp = int(cfg.parallel.tensor_parallel_size or 1)
    pp = 1  # --pipeline-parallel-size is accepted as 1 only
    dp = int(cfg.parallel.data_parallel_size or 1)
    num_blocks = next((int(i["num_blocks"]) for i in workers.values() if "num_blocks" in i), None)
    device = next((str(i["device"]).split(":")[0] for i in workers.values() if i.get("device")), "cpu")
    state_slots = max((int(i.get("state_slots") or 0) for i in workers.values()), default=0)
    checkpoints = min((int(i.get("state_checkpoints") or 0) for i in workers.values()), default=0)
    return {
        "model_config": {
            "model": model.root, "tokenizer": None if cfg.rl.tokens_only else model.root,
            "skip_tokenizer_init": cfg.rl.tokens_only, "served_model_name": model.names[0],
            "dtype": _dtype_name(workers, cfg.model.dtype), "max_model_len": model.max_model_len,
            "seed": cfg.model.seed,
            "max_logprobs": cfg.model.max_logprobs, "logprobs_mode": cfg.rl.logprobs_mode,
            "enable_sleep_mode": cfg.rl.enable_sleep_mode, "enable_trace_replay": cfg.rl.enable_trace_replay,
            "return_sampling_mask": cfg.rl.return_sampling_mask,
            "generation_config": cfg.model.generation_config,
        },
        "cache_config": {"block_size": cfg.cache.block_size, "cache_dtype": cfg.cache.kv_cache_dtype,
                         "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION
                         if cfg.cache.gpu_memory_utilization is None else cfg.cache.gpu_memory_utilization,
                         # as the scheduler has them (a hybrid's checkpoints; rollbus's --in-batch-prefix-sharing)
                         "enable_prefix_caching": prefix_caching_on(cfg.cache, state_slots, checkpoints),
                         "in_batch_prefix_sharing": in_batch_sharing_on(cfg.cache, state_slots, checkpoints),
                         "num_gpu_blocks_override": cfg.cache.num_gpu_blocks_override, "num_gpu_blocks": num_blocks,
                         "kv_cache_memory_bytes": cfg.cache.kv_cache_memory_bytes},
        "parallel_config": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": dp,
                            "world_size": tp * pp, "world_size_across_dp": tp * pp * dp,
                            "data_parallel_size_local": cfg.parallel.data_parallel_size_local or dp,
                            "worker_extension_cls": cfg.parallel.worker_extension_cls
                            or ""},
        "scheduler_config": {"max_num_seqs": cfg.scheduler.max_num_seqs,
                             "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                             "enable_chunked_prefill": True,
                             "policy": cfg.scheduler.scheduling_policy,
                             "async_scheduling": async_scheduling_on(cfg.scheduler, device)},
        "device_config": {"device": device},
        "load_config": {"load_format": cfg.model.load_format},
        "aux_output_config": {"enable_return_routed_experts": cfg.rl.enable_return_routed_experts},
        "weight_transfer_config": weight_transfer,
        "additional_config": cfg.rl.additional_config.raw,
    }


def vllm_config_text(c: dict[str, Any]) -> str:
    """vLLM's default (config_format=text): its VllmConfig.__str__ line, with the keys we have."""
    m, p = c["model_config"], c["parallel_config"]
    return (f"model={m['model']!r}, tokenizer={m['tokenizer']!r}, skip_tokenizer_init={m['skip_tokenizer_init']}, "
            f"dtype={m['dtype']}, max_seq_len={m['max_model_len']}, load_format={c['load_config']['load_format']}, "
            f"tensor_parallel_size={p['tensor_parallel_size']}, pipeline_parallel_size={p['pipeline_parallel_size']}, "
            f"data_parallel_size={p['data_parallel_size']}, device_config={c['device_config']['device']}, "
            f"seed={m['seed']}, served_model_name={m['served_model_name']}, "
            f"enable_prefix_caching={c['cache_config']['enable_prefix_caching']}, enable_chunked_prefill=True")


def vllm_env() -> dict[str, str]:
    """vLLM's `vllm_env`: the VLLM_* variables set, without any whose name holds KEY."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k}
