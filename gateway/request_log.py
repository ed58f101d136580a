"""The log flags of `vllm serve` that concern HTTP requests: `--enable-log-requests` (one line per engine
request: id and sampling parameters at info, prompt token ids at debug, cut to `--max-log-len`) and
`--disable-access-log-for-endpoints` (a filter on uvicorn's access log)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import structlog

log = structlog.get_logger()


def log_request(request_id: str, prompt_ids: list[int], params: Any, max_log_len: int | None) -> None:
    if dataclasses.is_dataclass(params):
        fields = dataclasses.asdict(params)
    else:  # a msgspec Struct
        fields = {f: getattr(params, f) for f in getattr(params, "__struct_fields__", ())}
    log.info("gateway.request", request_id=request_id, prompt_tokens=len(prompt_ids),
             params={k: v for k, v in fields.items() if v not in (None, [], {})})
    shown = prompt_ids if max_log_len is None else prompt_ids[:max_log_len]
    log.debug("gateway.request_prompt", request_id=request_id, prompt_token_ids=shown,
              truncated=len(shown) < len(prompt_ids))


class AccessLogFilter(logging.Filter):
    """Drops uvicorn access-log records of the given paths (query strings ignored)."""

    def __init__(self, paths: str | None):
        super().__init__()
        self.paths = {p.strip() for p in (paths or "").split(",") if p.strip()}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        # uvicorn's access record: (client, method, full_path, http_version, status)
        path = str(args[2]).split("?", 1)[0] if len(args) >= 3 else ""
        return path not in self.paths


def install_access_filter(paths: str | None) -> None:
    if paths:
        logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(paths))
