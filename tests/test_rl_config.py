import pytest

from engine.rl_config import dev_endpoints_enabled, parse_additional_config, worker_env_updates

pytestmark = pytest.mark.unit


def test_defaults_and_master_switch():
    assert not parse_additional_config(None).rl.enabled
    cfg = parse_additional_config('{"rl_config": {"enabled": true, "enable_batch_invariant": true}}')
    assert cfg.rl.effective()["enable_batch_invariant"] and cfg.weight_nz_mode == 0
    off = parse_additional_config('{"rl_config": {"enable_batch_invariant": true}, "weight_nz_mode": 2}')
    assert off.rl.effective() == {"enabled": False, "sleep_mode_extra_cleanup": False,
                                  "enable_training_consistency": False, "enable_batch_invariant": False}
    assert off.weight_nz_mode == 2  # untouched without the master switch


@pytest.mark.parametrize("text, message", [
    ('{"rl_config": []}', "rl_config must be a dict, got list"),
    ('{"rl_config": {"enabled": true, "refresh": true}}', "Unknown rl_config keys: ['refresh']"),
    ('{"rl_config": {"enabled": "yes"}}', "rl_config.enabled must be a bool, got str"),
    ('{"enable_sleep_mode_extra_cleanup": true}', "has been removed"),
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
])
def test_invalid_configs_are_refused_with_clear_messages(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_additional_config(text)


def test_dev_endpoints_and_worker_env():
    on = parse_additional_config('{"rl_config": {"enabled": true}}')
    off = parse_additional_config(None)
    assert dev_endpoints_enabled(on, {}) and not dev_endpoints_enabled(off, {})
    assert dev_endpoints_enabled(off, {"VLLM_SERVER_DEV_MODE": "1"})
    env = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    up = worker_env_updates(on, env)
    assert up["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:64"
    assert up["PYTORCH_CUDA_ALLOC_CONF"] is None and up["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert worker_env_updates(off, env) == {}


def test_cli_refuses_a_bad_config():
    from engine.config import parse_config

    with pytest.raises(SystemExit, match="must be a bool"):
        parse_config(["--additional-config", '{"rl_config": {"enabled": 1}}'])
