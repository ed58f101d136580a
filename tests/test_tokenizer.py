"""gateway.tokenizer against transformers: ids, chat templates (SmolLM2 and the real Qwen3 template),
and the streaming detokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest

from gateway import tokenizer as tokenizer_module
from gateway.tokenizer import Tokenizer
from tests.fixtures_models import require_qwen3_tokenizer_dir, smollm2_dir  # noqa: F401

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")

STRINGS = [
    "Hello world", "The year 2024 had 366 days.", " leading space", "naïve café — “quotes”",
    "日本語のテキスト、中文字符", "emoji 😀🎉👍🏽 flag 🇯🇵 family 👨‍👩‍👧", "def f(x):\n    return x**2  # c\n",
    "<|im_start|>user\nHi<|im_end|>\n", "  multiple   spaces\n\n\nnewlines", "don't I'll",
    "<think>\nplan</think>\n\nanswer", "{\"a\": [1, 2.5, null]}", "Привет мир", "",
]
STREAM_TEXT = "Streaming 😀 emoji, 日本語 and 中文, flags 🇯🇵🇫🇷, family 👨‍👩‍👧‍👦, accents é ñ ü, done."

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語で"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt is 21C."}, {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "hmm"},
     {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_dir(require_qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def qwen3_ref():  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(require_qwen3_tokenizer_dir()))


@pytest.fixture(scope="module")
def smol_ref(smollm2_dir: Path):  # type: ignore[no-untyped-def]  # noqa: F811
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_smollm2_ids_and_specials(smol: Tokenizer, smol_ref) -> None:  # type: ignore[no-untyped-def]
    for s in STRINGS:
        ids = smol.encode(s)
        assert ids == smol_ref.encode(s, add_special_tokens=False), s
        assert smol.decode(ids, skip_special_tokens=False) == s
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and smol.eos_token_ids == [2]
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # no BOS by default
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.decode(smol.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_qwen3_ids_and_specials(qwen3: Tokenizer, qwen3_ref) -> None:  # type: ignore[no-untyped-def]
    for s in STRINGS:
        assert qwen3.encode(s) == qwen3_ref.encode(s, add_special_tokens=False), s
    assert qwen3.vocab_size == 151669
    assert qwen3.token_to_id("<think>") == 151667 and qwen3.token_to_id("</think>") == 151668
    assert 151645 in qwen3.eos_token_ids and qwen3.bos_token_id is None
    assert qwen3.decode([151667]) == "<think>"  # user-defined, not special: survives skip_special_tokens


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_smollm2_matches_transformers(smol: Tokenizer, smol_ref, conv: int) -> None:  # type: ignore[no-untyped-def]
    for gen in (True, False):
        want = smol_ref.apply_chat_template(CONVERSATIONS[conv], add_generation_prompt=gen, tokenize=False)
        assert smol.apply_chat_template(CONVERSATIONS[conv], add_generation_prompt=gen) == want


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_qwen3_matches_transformers(qwen3: Tokenizer, qwen3_ref, conv: int) -> None:  # type: ignore[no-untyped-def]
    for gen in (True, False):
        for tools in (None, TOOLS):
            for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                want = qwen3_ref.apply_chat_template(CONVERSATIONS[conv], add_generation_prompt=gen, tools=tools,
                                                     tokenize=False, **kwargs)
                got = qwen3.apply_chat_template(CONVERSATIONS[conv], add_generation_prompt=gen, tools=tools, **kwargs)
                assert got == want, (gen, tools, kwargs)


def test_reasoning_field_aliases(qwen3: Tokenizer) -> None:
    base = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    std = [dict(m) for m in base]
    std[1]["reasoning_content"] = "deep"
    alias = [dict(m) for m in base]
    alias[1]["reasoning"] = "deep"
    assert qwen3.apply_chat_template(alias) == qwen3.apply_chat_template(std)


def test_template_helpers() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    tok = Tokenizer(backend=Backend(BPE()), chat_template=(
        "{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "<&>é"}]) == \
        '{"role": "user", "content": "<&>é"}|4'  # no HTML escaping, no ASCII escaping
    with pytest.raises(jinja2.TemplateError, match="empty"):
        tok.apply_chat_template([])
    sandboxed = Tokenizer(backend=Backend(BPE()), chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template([])


def _stream(tok: Tokenizer, ids: list[int], context: list[int], sizes: list[int]) -> tuple[list[str], str]:
    det = tok.new_detokenizer(context)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(det.push(ids[i:i + n]))
        i, k = i + n, k + 1
    return deltas, det.text


@pytest.mark.parametrize("which", ["smol", "qwen3"])
@pytest.mark.parametrize("fallback", [False, True])
def test_detokenizer_deltas_concatenate_to_decode(which: str, fallback: bool, request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if fallback:  # the offset method used when tokenizers has no DecodeStream
        monkeypatch.setattr(tokenizer_module, "DecodeStream", None)
    tok: Tokenizer = request.getfixturevalue(which)
    ids = tok.encode(STREAM_TEXT)
    rng = random.Random(0)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    for context in ([], prompt):
        for sizes in ([1], [2], [3], [rng.randint(1, 5) for _ in range(50)]):
            deltas, text = _stream(tok, ids, context, sizes)
            assert "".join(deltas) == text == tok.decode(ids) == STREAM_TEXT
            assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_partial_characters(smol: Tokenizer) -> None:
    ids = smol.encode("😀")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    det = smol.new_detokenizer()
    deltas = [det.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_detokenizer_special_tokens(smol: Tokenizer) -> None:
    ids = smol.encode("Hi<|im_end|>")
    det = smol.new_detokenizer()
    assert "".join(det.push([i]) for i in ids) == "Hi"
    keep = smol.new_detokenizer(skip_special_tokens=False)
    assert "".join(keep.push([i]) for i in ids) == "Hi<|im_end|>"


def test_generation_config_eos_list(smollm2_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [2, 0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [2, 0]


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)
