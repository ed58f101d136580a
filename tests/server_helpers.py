"""Integration-test helpers around the real engine (see tests.serve_process)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.serve_process import Server, free_port, free_port_range, sized_for_tests, start_server  # noqa: F401  (re-exported for tests)


def tiny_model_with_tokenizer(arch: str, folder: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A tiny random checkpoint with a real tokenizer beside it, servable by the gateway. `overrides` go to
    make_tiny_checkpoint (vocab_size=<the tokenizer's> makes text prompts valid)."""
    from tests.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(arch, folder, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# A reasoning turn that calls two tools, and one that answers (hermes tool calls, Qwen3 <think> reasoning)
TOOL_CALLS = ('<think>\nThe user wants both.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ONE_TOOL_CALL = TOOL_CALLS.split('\n<tool_call>\n{"name": "get_time"')[0]
ANSWER = "<think>\nI have the weather.\n</think>\n\nIt is sunny in Paris."


def qwen3_tool_server(work: Path) -> Server:
    """A tiny random Qwen3 checkpoint with the real Qwen3 tokenizer and chat template, served with
    --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 and trace replay (a random model
    calls no tools by itself: `forced` makes it)."""
    from tests.fixtures_models import require_qwen3_tokenizer_dir
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint("qwen3", work / "qwen3", vocab_size=151936, max_position_embeddings=2048)
    for f in require_qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, folder / f.name)
    return start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "2048",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                        "--enable-trace-replay", "--enable-scale-out")


def openai_client(server: Server) -> Any:
    """The official openai client on a test server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def forced(tok: Any, text: str) -> dict[str, Any]:
    """The extra body that makes the engine emit exactly `text` (then <|im_end|>): trace replay."""
    return {"vllm_xargs": {"trace_decode_token_ids": tok.encode(text) + [tok.token_to_id("<|im_end|>")]}}


def run_weather_agent(server: Server, tok: Any, model_class: Any,
                      answered: Callable[[dict[str, Any]], bool]) -> tuple[str, list[str], list[dict[str, Any]]]:
    """pydantic-ai, unmodified, runs a two-turn tool loop on `model_class` (OpenAIChatModel,
    OpenAIResponsesModel): turn 1 calls get_weather (run by the framework), turn 2 answers from the result.
    The forced outputs ride on the framework's own HTTP client: an httpx request hook adds the trace of the turn
    (the tool call until `answered(body)` sees the tool's result in the request, the answer after), which the
    framework never sees; everything else is the framework's own request. Returns the agent's output, the
    cities the tool was called with, and the request bodies."""
    from pydantic_ai import Agent
    from pydantic_ai.providers.openai import OpenAIProvider

    turns: list[dict[str, Any]] = []

    async def add_trace(request: httpx.Request) -> None:
        body = json.loads(request.content)
        body.update(forced(tok, ANSWER if answered(body) else ONE_TOOL_CALL))
        turns.append(body)
        request.stream = httpx.ByteStream(json.dumps(body).encode())
        request.headers["content-length"] = str(len(request.stream._stream))

    http = httpx.AsyncClient(event_hooks={"request": [add_trace]}, timeout=60)
    agent = Agent(model_class("tiny", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="x",
                                                              http_client=http)))
    seen: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    return agent.run_sync("Weather in Paris?").output, seen, turns
