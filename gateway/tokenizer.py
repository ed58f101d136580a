"""The engine's tokenizer: a Hugging Face folder's tokenizer.json (via `tokenizers`), its chat template
(rendered with a sandboxed jinja2 like transformers does), and incremental detokenisation for streaming.

transformers is deliberately not used here: it is a test oracle only, and importing it costs seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: fall back to the offset method
    DecodeStream = None  # type: ignore[assignment,misc]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 4  # prompt ids fed to the detokenizer as context, so the first delta is spaced right
_REASONING_ALIASES = ("reasoning", "thinking")  # other names clients use for `reasoning_content`


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def resolve_chat_template(value: str) -> str:
    """vLLM's --chat-template rule: a path that opens is read; otherwise a value containing '{', '}' or a
    newline is the template itself; anything else looked like a path that does not exist (an error: vLLM
    would also try its built-in template folder, which rollbus does not ship). The result is compiled
    once here, so a broken template fails at start-up, naming the flag."""
    try:
        with open(Path(value).expanduser(), encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened "
                             f"({e.strerror}); pass an existing file or the template itself") from None
        text = value
    try:
        compile_chat_template(text)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return text


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template text; same environment options and helpers as transformers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass
class Tokenizer:
    """Encode/decode, chat templates and streaming detokenisation for one model folder."""

    backend: _HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    generation_eos_ids: list[int] = field(default_factory=list)
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json from an HF folder."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"  # newer transformers save the template beside the config
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special |= {int(i) for i, t in cfg.get("added_tokens_decoder", {}).items() if t.get("special")}
        gen_eos = gen.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(backend=backend, chat_template=template, bos_token=_token_str(cfg.get("bos_token")),
                   eos_token=_token_str(cfg.get("eos_token")), pad_token=_token_str(cfg.get("pad_token")),
                   unk_token=_token_str(cfg.get("unk_token")), generation_eos_ids=gen_eos_ids,
                   special_ids=frozenset(special))

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids. No BOS unless asked for and the tokenizer's post-processor adds one."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def vocab_size(self) -> int:
        """Max id + 1, counting added tokens (the model's embedding may still be larger)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.backend.token_to_id(self.pad_token) if self.pad_token else None

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's eos plus generation_config's eos ids (Qwen lists several), deduplicated."""
        ids: list[int] = []
        first = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        for i in ([first] if first is not None else []) + self.generation_eos_ids:
            if i not in ids:
                ids.append(i)
        return ids

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' `apply_chat_template(tokenize=False)`.
        Extra kwargs (e.g. `enable_thinking=False` for Qwen3) reach the template as variables."""
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat_template")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "pad_token": self.pad_token, "unk_token": self.unk_token}
        variables.update(template_kwargs)
        return compile_chat_template(source).render(
            messages=[_alias_reasoning(m) for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, **variables)

    # ------------------------------------------------------------------ streaming

    def new_detokenizer(self, prompt_ids: list[int] | None = None,
                        skip_special_tokens: bool = True) -> Detokenizer:
        """An incremental detokenizer for one sequence; `prompt_ids` give context for the first delta."""
        return Detokenizer(self, list(prompt_ids or [])[-_PROMPT_CONTEXT:], skip_special_tokens)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read `reasoning_content`; accept the other names clients send it under."""
    if message.get("reasoning_content") is None:
        for key in _REASONING_ALIASES:
            if message.get(key) is not None:
                return {**message, "reasoning_content": message[key]}
    return message


class Detokenizer:
    """Turns a growing list of generated ids into text deltas. A delta never ends in half a UTF-8
    character: bytes of a character split over tokens are held back until the character completes,
    so the concatenated deltas equal `decode(all_generated_ids)`."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self._stream = (DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
                        if DecodeStream is not None else None)
        # Offset-method state (fallback): ids window, and where the already-emitted text ends in it.
        self._ids = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the newly completed text (possibly "")."""
        if not token_ids:
            return ""
        if self._stream is not None:
            delta = self._stream.step(self._tok.backend, list(token_ids)) or ""
        else:
            delta = self._push_offsets(token_ids)
        self.text += delta
        return delta

    def _push_offsets(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""
