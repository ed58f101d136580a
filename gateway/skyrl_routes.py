"""POST /skyrl/v1/generate: the generate route SkyRL 0.4's own vLLM server actor adds, and that its
RemoteInferenceClient calls instead of /inference/v1/generate when routed experts are asked for
(`return_routed_experts`). Same shapes as SkyRL's (skyrl/.../inference_servers/vllm_server_actor.py):

    in:  {"token_ids": [...], "sampling_params": {vLLM SamplingParams fields}, "model": ..., "cache_salt": ...,
          "return_sample_support": false}
    out: {"choices": [{"token_ids": [...], "finish_reason": "stop" | "length" | "abort",
                       "logprobs": {"content": [{"logprob": lp}, ...]} | null,
                       "routed_experts": {"data": base64, "shape": [...], "dtype": "uint8"} | null,
                       "rollout_sample_support": null}]}

Gated like /inference/v1/generate (scale-out on; the fleet actor turns it on, as SkyRL's does). One choice:
SkyRL sends n=1 and reads choices[0]. `return_sample_support` (the top-k support of each sampled token) is
refused with a 400 naming it: rollbus does not capture it yet.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.choice_runner import collect
from gateway.choice_state import routed_experts_rows
from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import bad_request
from gateway.protocol.generate import GenerateRequest
from gateway.response_parts import clamp_logprob
from gateway.responses import JSONResponse
from gateway.serving import ServingContext, request_base_id
from gateway.serving_generate import check_enabled, prepare


class SkyrlGenerateRequest(GenerateRequest):
    return_sample_support: bool = False


def packed(rows: np.ndarray | None) -> dict[str, Any] | None:
    """SkyRL's packed-array envelope (generate_wire.pack_ndarray): the raw C-order bytes in base64."""
    if rows is None:
        return None
    rows = np.ascontiguousarray(rows)
    return {"data": base64.b64encode(rows.tobytes()).decode("ascii"), "shape": list(rows.shape),
            "dtype": rows.dtype.name}


async def create_skyrl_generate(ctx: ServingContext, body: SkyrlGenerateRequest, request: Request) -> Response:
    check_enabled(ctx)
    ctx.check_ready(body.model)
    if body.return_sample_support:
        raise bad_request("return_sample_support is not supported by rollbus: it does not capture the top-k "
                          "support of sampled tokens; request logprobs instead.", "return_sample_support")
    if body.stream:
        raise bad_request("/skyrl/v1/generate answers with one JSON body; use /inference/v1/generate to stream.",
                          "stream")
    if body.sampling_params.n != 1:
        raise bad_request("/skyrl/v1/generate returns one choice: sampling_params.n must be 1.", "sampling_params.n")
    request_id = "skyrl-generate-" + request_base_id(request, body.request_id, lambda: uuid.uuid4().hex)
    states = prepare(ctx, body, request_id)
    ctx.admit(request, states)
    try:
        await until_disconnected(request.receive, collect(ctx, states))
    except ClientDisconnected:
        return Response(status_code=499)
    s = states[0]
    logprobs = None
    if s.params.logprobs is not None and s.logprobs is not None:
        logprobs = {"content": [{"logprob": clamp_logprob(lp)} for lp in s.logprobs]}
    return JSONResponse({"choices": [{
        "token_ids": s.token_ids, "finish_reason": s.finish_reason or "stop", "logprobs": logprobs,
        "routed_experts": packed(routed_experts_rows(s)), "rollout_sample_support": None}],
        "created": int(time.time())})


def add_skyrl_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/skyrl/v1/generate")
    async def skyrl_generate(request: Request) -> Response:
        body = SkyrlGenerateRequest.model_validate_json(await request.body())
        return await create_skyrl_generate(ctx, body, request)
