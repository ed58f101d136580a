"""A server started with a `vllm serve` command line (only the command name changed) serves accordingly:
dummy weights, an inline chat template, a generation-config folder plus override, a --config YAML that
the command line overrides, underscores, -tp 1, no-op flags noted, log flags, and a worker extension
whose methods answer through /collective_rpc in vLLM's shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from gateway.tokenizer import Tokenizer
from tests.server_helpers import start_server

pytestmark = pytest.mark.timeout(240)

TEMPLATE = ("{{ greeting }}{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}[assistant:{% endif %}")
EXTENSION = "tests.worker_extension.ChecksumExtension"


def dummy_model_folder(root: Path, smollm2_dir: Path) -> Path:
    """SmolLM2's config cut to 2 layers and its tokenizer; no weights at all (--load-format dummy reads none)."""
    folder = root / "model"
    folder.mkdir()
    config = json.loads((smollm2_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "max_new_tokens": 100}))
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("vllm_cli")
    folder = dummy_model_folder(root, smollm2_dir)
    gen = root / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 3}))
    (root / "serve.yaml").write_text("max-model-len: 256\nserved_model_name:\n  - vllm-style\nmax-num-seqs: 8\n"
                                     "kv_cache_memory_bytes: 64M\nenable-prefix-caching: false\n")
    server = start_server(
        root, str(folder), "--config", str(root / "serve.yaml"), "--max_model_len", "512", "-tp", "1",
        "--load-format", "dummy", "--chat-template", TEMPLATE, "--generation-config", str(gen),
        "--override-generation-config", '{"temperature": 0.0}', "--worker-extension-cls", EXTENSION,
        "--additional-config.rl_config.enabled", "true", "--enforce-eager", "--trust-remote-code",
        "--disable-log-stats", "--disable-uvicorn-access-log", "--enable-log-requests", "--uvicorn-log-level",
        "info", "--default-chat-template-kwargs", '{"greeting": "hi"}', "--return_tokens_as_token_ids")
    yield server, Tokenizer.from_dir(folder)
    server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_models_reflect_the_yaml_and_the_command_line_over_it(served):
    server, _ = served
    (model,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert model["id"] == "vllm-style" and model["max_model_len"] == 512


def test_no_op_flags_are_noted_once(served):
    server, _ = served
    log = server.log()
    for flag in ("--enforce-eager", "--trust-remote-code", "--disable-log-stats"):
        assert log.count(f"rollbus: {flag} has no effect here") == 1, flag


def test_the_chat_template_flag_renders_the_prompt(served):
    server, tok = served
    r = post(server, "/v1/chat/completions", {"model": "vllm-style", "max_tokens": 1, "return_token_ids": True,
                                             "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False) == "hi[user:hello][assistant:"
    r = post(server, "/v1/chat/completions", {"model": "vllm-style", "max_tokens": 1, "return_token_ids": True,
                                             "messages": [{"role": "user", "content": "hello"}],
                                             "chat_template_kwargs": {"greeting": "yo"}})
    assert tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False) == "yo[user:hello][assistant:"


def test_return_tokens_as_token_ids_is_the_servers_default(served):
    server, _ = served
    body = {"model": "vllm-style", "prompt": "Tokens", "max_tokens": 2, "logprobs": 1}
    tokens = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens), tokens
    tokens = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()[
        "choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in tokens), tokens


def test_a_request_chat_template_needs_the_trust_flag(served):
    server, _ = served
    r = post(server, "/v1/chat/completions", {"model": "vllm-style", "max_tokens": 1, "chat_template": "{{ 'x' }}",
                                             "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


def test_generation_config_sets_the_defaults_and_requests_override_them(served):
    server, _ = served
    body = {"model": "vllm-style", "messages": [{"role": "user", "content": "The weather"}], "ignore_eos": True,
            "n": 3}
    r = post(server, "/v1/chat/completions", body)  # chat: no max_tokens of its own (completions default to 16)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 9  # max_new_tokens 3 from the folder, not 100
    assert len({c["message"]["content"] for c in r.json()["choices"]}) == 1  # temperature 0.0 (override): greedy
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 6, "temperature": 1.0, "n": 4})
    assert r.json()["usage"]["completion_tokens"] == 24
    assert len({c["message"]["content"] for c in r.json()["choices"]}) > 1  # the request's own values win


def test_requests_are_logged_and_access_lines_are_not(served):
    server, _ = served
    r = post(server, "/v1/completions", {"model": "vllm-style", "prompt": "Log me", "max_tokens": 1,
                                         "request_id": "logged-request-42"})
    assert r.status_code == 200, r.text
    log = server.log()
    assert "gateway.request" in log and "logged-request-42" in log
    assert '"POST /v1/completions HTTP/1.1" 200' not in log


def test_dummy_weights_are_vllms_and_the_extension_reads_them(served):
    server, _ = served
    r = post(server, "/collective_rpc", {"method": "param_checksum", "args": ["model.embed_tokens.weight"]})
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]  # one entry per worker
    expected = torch.empty(49152, 576).uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))
    assert result["sum"] == float(expected.double().sum())
    assert result["head"] == [float(x) for x in expected.reshape(-1)[:4].double()]
    assert (result["rank"], result["device"], result["ready"]) == (0, "cpu", True)  # init hook ran


def test_extension_results_have_vllms_shape_and_unknown_methods_are_400(served):
    server, _ = served
    assert post(server, "/collective_rpc", {"method": "count"}).json() == {"results": ["3"]}
    for method in ("start", "no_such_method", "_private"):
        r = post(server, "/collective_rpc", {"method": method})
        assert r.status_code == 400 and method in r.json()["error"]["message"], method
    r = post(server, "/collective_rpc", {"method": "param_checksum", "args": "not a list"})
    assert r.status_code == 400
    r = post(server, "/collective_rpc", {"method": "tensor_dict"})
    assert r.status_code == 500 and "tensor_dict returned a dict that is not JSON" in r.json()["error"]["message"]
    assert post(server, "/collective_rpc", {"method": "count"}).json() == {"results": ["3"]}  # still serving


def test_an_extension_loads_weights_the_vllm_way(served):
    server, _ = served
    name = "model.norm.weight"
    r = post(server, "/collective_rpc", {"method": "fill_param", "kwargs": {"name": name, "value": "0.5"}})
    assert r.status_code == 200 and r.json() == {"results": [None]}, r.text
    (result,) = post(server, "/collective_rpc", {"method": "param_checksum", "args": [name]}).json()["results"]
    assert result["sum"] == 0.5 * 576 and result["head"] == [0.5] * 4
    r = post(server, "/v1/completions", {"model": "vllm-style", "prompt": "Still", "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_a_bad_extension_class_stops_start_up_naming_it(tmp_path, smollm2_dir):
    folder = dummy_model_folder(tmp_path, smollm2_dir)
    with pytest.raises(RuntimeError) as e:
        start_server(tmp_path, str(folder), "--load-format", "dummy", "--max-model-len", "256",
                     "--worker-extension-cls", "tests.worker_extension.Missing", timeout_s=120)
    assert "tests.worker_extension.Missing" in str(e.value) and "has no class Missing" in str(e.value)
