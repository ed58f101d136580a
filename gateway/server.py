"""The gateway process: bind the HTTP port first (a taken port fails fast and clearly), load the model's
tokenizer and limits, serve the app with uvicorn on uvloop, and tell the launcher once it is serving.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import structlog
import uvicorn
import zmq

from bus.endpoints import Endpoints
from bus.messages import GatewayReady
from bus.sockets import report_ready
from bus.topology import Topology
from engine.config import EngineConfig
from engine.generation_defaults import default_sampling_params
from engine.logs import setup_logging
from gateway.app import build_app
from gateway.engine_client import EngineClient
from gateway.request_log import install_access_filter
from gateway.serving import ModelInfo

log = structlog.get_logger()



def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port or exit with a message saying why (port taken, bad address)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"rollbus gateway: port {port} on {host} is already in use "
                             f"(another server running? pick one with --port)") from None
        raise SystemExit(f"rollbus gateway: cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


def load_model_info(cfg: EngineConfig, folder: Path) -> ModelInfo:
    """Served names, context length and vocabulary size from config.json; generation defaults."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text_config = config.get("text_config") or {}
    vocab = config.get("vocab_size") or text_config.get("vocab_size")
    derived = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    max_model_len = cfg.model.max_model_len or derived
    if not vocab or not max_model_len:
        raise SystemExit(f"rollbus gateway: {folder}/config.json lacks vocab_size or max_position_embeddings "
                         f"(set --max-model-len)")
    if derived and cfg.model.max_model_len and cfg.model.max_model_len > derived:
        log.warning("gateway.max_model_len_above_model", max_model_len=cfg.model.max_model_len, model_limit=derived)
    gen_path = folder / "generation_config.json"
    gen: dict[str, Any] = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
    defaults = default_sampling_params(cfg.model.generation_config, folder, cfg.model.override_generation_config)
    if defaults and cfg.model.generation_config != "vllm":
        source = cfg.model.generation_config
        source = "the model's generation_config.json" if source == "auto" else source
        log.info("gateway.generation_defaults", note=f"Default sampling parameters have been overridden by "
                 f"{source}; start with --generation-config vllm if this is not intended.", **defaults)
    names = list(cfg.model.served_model_name) or [cfg.model.model_name]
    eos: list[int] = []
    for source in (config, text_config, gen):  # what --tokens-only stops at, with no tokenizer to ask
        value = source.get("eos_token_id")
        for i in [value] if isinstance(value, int) else list(value or []):
            if i not in eos:
                eos.append(int(i))
    return ModelInfo(names=names, root=str(folder), max_model_len=int(max_model_len), vocab_size=int(vocab),
                     sampling_defaults=defaults, eos_token_ids=eos)


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT drain first (vLLM's --shutdown-timeout): new generation requests get
    503 while the listener stays open, running ones get `shutdown_timeout_s` to finish, the rest are
    aborted (each stream ends with an error chunk and [DONE]); then uvicorn shuts down. A second signal
    exits at once. The process then exits 0 (the signal is not re-raised)."""

    def __init__(self, config: uvicorn.Config, app: Any, client: EngineClient, shutdown_timeout_s: float):
        super().__init__(config)
        self.admission = app.state.admission
        self.client, self.shutdown_timeout_s = client, shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())  # held: not collected

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.admission.draining or self.loop is None or not self.started:
            self.force_exit = self.admission.draining  # a second signal: at once
            self.should_exit = True
            return
        self.admission.draining = True
        log.info("gateway.draining", running=self.admission.requests, shutdown_timeout=self.shutdown_timeout_s)
        self.loop.call_soon_threadsafe(self._start_drain)

    async def _drain(self) -> None:
        try:
            if not self.admission.idle.is_set():  # (wait_for with timeout 0 times out even on a set event)
                await asyncio.wait_for(self.admission.idle.wait(), self.shutdown_timeout_s)
        except asyncio.TimeoutError:
            pending = list(self.client.queues)
            log.warning("gateway.shutdown_abort", requests=len(pending))
            if pending:
                await self.client.abort(pending)
            # 503 on every open request (the engine is going away with this server)
            self.client._fail_all("the server is shutting down: the request was aborted (--shutdown-timeout)")
            try:  # the streams now end with their error chunk and [DONE]
                await asyncio.wait_for(self.admission.idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        self.should_exit = True


def _http_impl() -> str:
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


async def _serve(server: uvicorn.Server, sock: socket.socket, cfg: EngineConfig, client: EngineClient) -> bool:
    """Serve until shut down; report READY once uvicorn accepts connections. Returns whether it started."""
    if isinstance(server, DrainingServer):
        server.loop = asyncio.get_running_loop()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
        await asyncio.to_thread(report_ready, zmq.Context.instance(), cfg.bus.ready_endpoint, "gateway",
                                client.name, GatewayReady(url))
        log.info("gateway.serving", url=url, http=_http_impl())
    await task
    return server.started


def run_gateway_process(cfg: EngineConfig) -> None:
    """Entry point of `rollbus gateway`: returns when uvicorn shuts down; exits non-zero on failure."""
    setup_logging(cfg.log_level, process="gateway")
    from engine.model_store import resolve_model

    sock = bind_socket(cfg.gateway.host, cfg.gateway.port)
    folder = resolve_model(cfg.model.model, progress=False)
    tokenizer = None
    if cfg.rl.tokens_only:  # vLLM: skip tokenizer init entirely; nothing on the request path may need one
        log.info("gateway.tokens_only", note="Tokens-only mode is enabled: no tokenizer is loaded.")
    else:
        from gateway.tokenizer import Tokenizer, resolve_chat_template

        tokenizer = Tokenizer.from_dir(folder)
        if cfg.model.chat_template is not None:  # vLLM's --chat-template: a file path or the template itself
            tokenizer.chat_template = resolve_chat_template(cfg.model.chat_template)
    if cfg.rl.enable_trace_replay and os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip() == "0":
        log.info("gateway.model_runner", note="VLLM_USE_V2_MODEL_RUNNER=0 is ignored: rollbus has one model "
                                              "runner, and it supports trace replay.")
    info = load_model_info(cfg, folder)
    client = EngineClient(Endpoints.from_config(cfg), heartbeat_interval_s=cfg.bus.heartbeat_interval_s,
                          heartbeat_timeout_s=cfg.bus.heartbeat_timeout_s, topology=Topology.from_config(cfg))
    app = build_app(cfg, client, tokenizer, info)
    config = uvicorn.Config(app, host=cfg.gateway.host, port=cfg.gateway.port, loop="uvloop", http=_http_impl(),
                            log_level=cfg.gateway.uvicorn_log_level,
                            access_log=not cfg.gateway.disable_uvicorn_access_log,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app, client, float(cfg.gateway.shutdown_timeout))
    install_access_filter(cfg.gateway.disable_access_log_for_endpoints)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        uvloop = None
    runner = uvloop.run if uvloop is not None else asyncio.run
    started = runner(_serve(server, sock, cfg, client))
    if not started:
        raise SystemExit("rollbus gateway: failed to start (see the log above)")
