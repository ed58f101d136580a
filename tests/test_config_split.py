"""EngineConfig's sub-configs (engine/config/): every flag fills exactly one field, JSON flags arrive as their
typed structs, and a config survives to_argv -> parse_config (how `rollbus serve` configures its children)."""

from __future__ import annotations

import pytest

from engine.config import OWNER, EngineConfig, new_parser, parse_config
from engine.kv_events import KVEventsConfig
from engine.rl_config import AdditionalConfig
from engine.structured_outputs import StructuredOutputsConfig
from engine.weights.config import WeightTransferConfig

pytestmark = pytest.mark.unit

NOT_FIELDS = {"help", "config", "model_option", "num_workers_refused", "log_level"}


def test_every_flag_fills_one_sub_config_field():
    dests = {a.dest for a in new_parser()._actions if not a.dest.startswith("vllm__")} - NOT_FIELDS
    assert dests == set(OWNER), (dests ^ set(OWNER))
    assert set(EngineConfig().flags()) == set(OWNER) | {"log_level"}


def test_json_flags_are_parsed_once_into_structs():
    cfg = parse_config(["--additional-config", '{"rl_config": {"enabled": true}}', "--weight-transfer-config",
                        '{"backend": "ipc"}', "--kv-events-config", '{"enable_kv_cache_events": true}',
                        "--structured-outputs-config", '{"disable_any_whitespace": true}',
                        "--default-chat-template-kwargs", '{"enable_thinking": false}',
                        "--override-generation-config", '{"temperature": 0.5}'])
    assert isinstance(cfg.rl.additional_config, AdditionalConfig) and cfg.rl.additional_config.rl.enabled
    assert isinstance(cfg.rl.weight_transfer_config, WeightTransferConfig)
    assert cfg.rl.weight_transfer_config.backend == "ipc"
    assert isinstance(cfg.cache.kv_events_config, KVEventsConfig) and cfg.cache.kv_events_config.publishing
    assert isinstance(cfg.model.structured_outputs_config, StructuredOutputsConfig)
    assert cfg.model.structured_outputs_config.disable_any_whitespace
    assert cfg.model.default_chat_template_kwargs == {"enable_thinking": False}
    assert cfg.model.override_generation_config == {"temperature": 0.5}
    assert parse_config(cfg.to_argv()) == cfg
    bare = EngineConfig()
    assert bare.rl.weight_transfer_config is None and bare.cache.kv_events_config is None
    assert bare.to_argv() == []


def test_from_flags_takes_flag_dests_and_refuses_unknown_ones():
    cfg = EngineConfig.from_flags(max_num_seqs=4, bus_dir="/tmp/b", additional_config='{"rl_config": {}}')
    assert (cfg.scheduler.max_num_seqs, cfg.bus.bus_dir) == (4, "/tmp/b")
    assert isinstance(cfg.rl.additional_config, AdditionalConfig)
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_flags(max_num_seq=4)
    with pytest.raises(ValueError, match="Invalid weight transfer backend: tcp"):  # vLLM's words
        EngineConfig.from_flags(weight_transfer_config='{"backend": "tcp"}')
