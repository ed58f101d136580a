"""The HTTP process: where it listens, its key, its logs, and the load limits it enforces.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.argv import Switch, non_negative


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    return_tokens_as_token_ids: bool = False
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: str | None = None  # comma-separated paths
    enable_log_requests: bool = False
    max_log_len: int | None = None
    disable_fastapi_docs: bool = False
    max_num_queued_reqs: int = 16384  # vLLM's flag; vLLM's default is no limit
    max_num_queued_tokens: int | None = None  # vLLM's: prompt tokens waiting for prefill; None: no limit
    max_request_body_bytes: int = 32 * 1024 * 1024
    max_prompts_per_request: int = 4096
    max_prompt_tokens_per_request: int = 2 * 1024 * 1024
    max_stored_responses: int = 1024  # the Responses API's in-memory store (gateway/responses_store.py)
    shutdown_timeout: int = 0  # vLLM's: seconds SIGTERM waits for running requests; 0 aborts them


def add_args(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    g = p.add_argument_group("serving")
    g.add_argument("--host", default=d.host, help="HTTP listen address.")
    g.add_argument("--port", type=int, default=d.port, help="HTTP listen port.")
    g.add_argument("--api-key", nargs="+", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1 endpoints (env VLLM_API_KEY). One key "
                        "(vLLM accepts several; rollbus refuses more than one).")
    g.add_argument("--return-tokens-as-token-ids", action=Switch, default=d.return_tokens_as_token_ids,
                   help="Logprob tokens as 'token_id:N' for requests that do not set return_tokens_as_token_ids.")
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
    g = p.add_argument_group("load limits and graceful stop (docs/serving.md)")
    g.add_argument("--max-num-queued-reqs", type=non_negative("--max-num-queued-reqs"), default=d.max_num_queued_reqs,
                   help="vLLM's admission limit, enforced in the gateway: at most this many engine sequences in "
                        "flight (waiting + running; a request counts n x prompts). Beyond it a new request gets "
                        "503 with Retry-After. vLLM's default is no limit; rollbus bounds the queue.")
    g.add_argument("--max-num-queued-tokens", type=non_negative("--max-num-queued-tokens"), default=None,
                   help="vLLM's prefill backlog limit, enforced in the gateway: while the prompt tokens of requests "
                        "that have no output yet reach this many, a new request gets 503 with Retry-After. "
                        "Default: no limit.")
    g.add_argument("--max-request-body-bytes", type=non_negative("--max-request-body-bytes"),
                   default=d.max_request_body_bytes,
                   help="Larger request bodies get 413 before they are parsed (rollbus; vLLM has no limit).")
    g.add_argument("--max-prompts-per-request", type=non_negative("--max-prompts-per-request"),
                   default=d.max_prompts_per_request,
                   help="A /v1/completions request with more prompts gets 400 naming `prompt` (rollbus).")
    g.add_argument("--max-prompt-tokens-per-request", type=non_negative("--max-prompt-tokens-per-request"),
                   default=d.max_prompt_tokens_per_request,
                   help="A request whose prompts hold more tokens in all gets 400 naming the prompt field (rollbus).")
    g.add_argument("--max-stored-responses", type=non_negative("--max-stored-responses"),
                   default=d.max_stored_responses,
                   help="POST /v1/responses keeps at most this many responses in the gateway's memory (for GET, "
                        "previous_response_id and cancel; none survive a restart). The oldest finished one makes "
                        "room for a new one; with every slot held by a running response, a stored request gets 429. "
                        "0: nothing is stored (store=true is a 400). vLLM stores with "
                        "VLLM_ENABLE_RESPONSES_API_STORE=1, without a bound (rollbus).")
    g.add_argument("--shutdown-timeout", type=non_negative("--shutdown-timeout"), default=d.shutdown_timeout,
                   help="vLLM's: on SIGTERM (or Ctrl-C) new requests get 503 and running ones get this many "
                        "seconds to finish; then the rest are aborted (an error, then [DONE]) and every process "
                        "stops, exit code 0. 0 aborts at once. A second signal stops at once.")
