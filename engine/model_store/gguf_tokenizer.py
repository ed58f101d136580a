"""Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json) built
from a GGUF file's BPE vocabulary, merges and metadata, with the `tokenizers` library."""

from __future__ import annotations

import json
from typing import Any

# Pre-tokenizer split patterns (llama.cpp `tokenizer.ggml.pre` name -> regex), as the original HF
# tokenizers define them; only the digit rule differs (Qwen: one digit per piece, Llama-3: up to three).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_NFC_PRES = {"qwen2", "deepseek-r1-qwen"}  # Qwen's own tokenizer.json normalises to NFC first
_CONTROL, _USER_DEFINED = 3, 4


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level BPE tokens."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(0x100 + i) for i, b in enumerate(extra)})
    return mapping


def _build_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the model's original tokenizer.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {model!r} is not supported (only byte-level 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spell = byte_alphabet()
    alphabet = set(spell.values())
    # Added tokens are stored as their text; the BPE vocab wants them in the byte alphabet.
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _NFC_PRES:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are special; user-defined ones (<think>, <tool_call>) are matched
    # whole but kept in decoded text. A control token outside the byte alphabet is a mislabel: skip it.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == _USER_DEFINED and t in vocab])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]}:0 $A:0", pair=f"{tokens[bos_id]}:0 $A:0 {tokens[bos_id]}:1 $B:1",
            special_tokens=[(tokens[bos_id], bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_files(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
    """The three tokenizer-side files of an HF folder, as JSON text."""
    tok = _build_tokenizer(meta)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tok_config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
    }
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    gen = {k: meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id")
           if f"tokenizer.ggml.{k}" in meta}
    if "tokenizer.ggml.padding_token_id" in meta:
        gen["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(gen, indent=2)}


