"""LoRA on the worker: the adapter versions it holds, and the grouped LoRA product of a mixed step.

Each sequence runs with one adapter version for its whole life (bus.sampling_params.LoraRef: id and
version). `LoraSlots` keeps the loaded versions keyed by (id, version) with a count of the sequences using
each; an idle one is dropped least recently used first beyond `max_cached` (--max-cpu-loras), and read again
from its folder when a sequence needs it. An in-place reload is a new version: sequences that started on
the old one keep it to their end, so no sequence ever mixes two versions; an old version that was dropped
cannot be read again (its folder holds the new weights), so a sequence that needs it then (a recompute after
preemption) fails alone, naming it, rather than mixing.

The product (vLLM's punica kernels do the same on GPUs, segmented by adapter): before a forward,
`begin_step` groups the step's token rows by adapter; each hooked projection (q/k/v/o, gate/up/down in
workers/models/llama.py) then adds, per group, B·(A·x)·scaling to that group's rows only. Base rows
cost nothing. A row's delta depends on its own input and its adapter's weights only, through the model's
`kern.linear`, so a row's bits do not depend on its batch-mates whenever the base product's do not
(docs/batch-invariance.md).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from bus.sampling_params import LoraRef
from engine.lora import LoraError, inspect_adapter, module_features

Key = tuple[int, int]  # (adapter id, version)
# fused projection of the decoder -> its PEFT parts, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


class AdapterWeights:
    """One adapter version on the device: per layer, per fused projection, one (A, B) pair: the targeted parts'
    A stacked [parts*r, in], their B·scaling placed block-diagonally [fused out, parts*r] (zero rows for
    untargeted parts), so a group's delta on a fused projection is two GEMMs and one add."""

    def __init__(self, ref: LoraRef, hf_config: dict, max_rank: int, dtype: torch.dtype, device: torch.device):
        from safetensors.torch import load_file

        spec = inspect_adapter(ref.name, ref.path, hf_config, max_rank)
        tensors = load_file(str(Path(ref.path) / "adapter_model.safetensors"))
        feats = module_features(hf_config)
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(hf_config["num_hidden_layers"])]
        targeted = set(spec.modules)
        for layer in range(len(self.layers)):
            for fused, parts in FUSED.items():
                mine = [m for m in parts if (layer, m) in targeted]
                if not mine:
                    continue
                block = "self_attn" if fused in ("qkv", "o") else "mlp"
                stems = {m: f"base_model.model.model.layers.{layer}.{block}.{m}" for m in mine}
                a = torch.cat([tensors[f"{stems[m]}.lora_A.weight"].float() for m in mine])  # [parts*r, in]
                b = torch.zeros(sum(feats[m][1] for m in parts), len(mine) * spec.rank)
                row = col = 0
                for m in parts:
                    if m in stems:
                        part = tensors[f"{stems[m]}.lora_B.weight"].float() * spec.scaling  # [out, r]
                        b[row:row + part.shape[0], col:col + spec.rank] = part
                        col += spec.rank
                    row += feats[m][1]
                self.layers[layer][fused] = (a.to(device=device, dtype=dtype).contiguous(),
                                             b.to(device=device, dtype=dtype).contiguous())


class LoraSlots:
    def __init__(self, hf_config: dict, kern, *, max_rank: int, max_cached: int, dtype: torch.dtype,
                 device: torch.device):
        self.hf_config, self.kern = hf_config, kern
        self.max_rank, self.max_cached, self.dtype, self.device = max_rank, max_cached, dtype, device
        self.loaded: OrderedDict[Key, AdapterWeights] = OrderedDict()  # least recently used first
        self.users: dict[Key, int] = {}
        self.newest: dict[int, int] = {}  # adapter id -> the latest version this worker loaded
        self.groups: list[tuple[torch.Tensor, AdapterWeights]] = []  # this step's (rows, adapter)

    def load(self, ref: LoraRef) -> AdapterWeights:
        """The weights of this version, read from its folder if not held (raises what the folder's check does)."""
        key = (ref.id, ref.version)
        w = self.loaded.get(key)
        if w is None:
            newest = self.newest.get(ref.id, 0)
            if ref.version < newest:  # its folder holds a later version now: computing with it would mix two
                raise LoraError(f"version {ref.version} of LoRA adapter {ref.name!r} was replaced by version "
                                f"{newest} and is no longer loaded on this worker (raise --max-cpu-loras)")
            w = AdapterWeights(ref, self.hf_config, self.max_rank, self.dtype, self.device)
            self.loaded[key] = w
            self.newest[ref.id] = ref.version
        self.loaded.move_to_end(key)
        self._evict()
        return w

    def acquire(self, ref: LoraRef) -> Key:
        self.load(ref)
        key = (ref.id, ref.version)
        self.users[key] = self.users.get(key, 0) + 1
        return key

    def release(self, key: Key) -> None:
        n = self.users.get(key, 0) - 1
        if n > 0:
            self.users[key] = n
        else:
            self.users.pop(key, None)
        self._evict()

    def _evict(self) -> None:
        idle = [k for k in self.loaded if k not in self.users]  # least recently used first
        while len(self.loaded) > self.max_cached and idle:
            del self.loaded[idle.pop(0)]

    def begin_step(self, row_keys: list[Key | None]) -> None:
        """Group this step's token rows by adapter (None: the base model)."""
        by_key: dict[Key, list[int]] = {}
        for i, k in enumerate(row_keys):
            if k is not None:
                by_key.setdefault(k, []).append(i)
        self.groups = [(torch.tensor(rows, dtype=torch.long, device=self.device), self.loaded[k])
                       for k, rows in by_key.items()]

    def end_step(self) -> None:
        self.groups = []

    def hook(self, layer: int, fused: str):
        """The function a projection calls after its base product: (x, out) -> out with each group's delta."""

        def add_delta(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            for rows, w in self.groups:
                ab = w.layers[layer].get(fused)
                if ab is not None:  # out[rows] += B·(A·x[rows]): elementwise per row, rows distinct
                    out.index_add_(0, rows, self.kern.linear(self.kern.linear(x.index_select(0, rows), ab[0]), ab[1]))
            return out

        return add_delta


def attach(model, slots: LoraSlots) -> None:
    """Give every decoder layer's projections their LoRA hook (workers/models/llama.py calls them)."""
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):
            raise NotImplementedError("--enable-lora: adapters on multi-head latent attention are not implemented")
        if not hasattr(mlp, "gate_up_proj"):
            raise NotImplementedError("--enable-lora: adapters on mixture-of-experts layers are not implemented")
        attn.lora_qkv, attn.lora_o = slots.hook(i, "qkv"), slots.hook(i, "o")
        mlp.lora_gate_up, mlp.lora_down = slots.hook(i, "gate_up"), slots.hook(i, "down")


def model_shape(model) -> dict:
    """The config keys engine.lora's checks read, from the built decoder."""
    c = model.cfg
    return {"hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers}


def slots_for(cfg, model, device: torch.device) -> LoraSlots | None:
    """The worker's adapter slots with --enable-lora (hooked into the model), else None."""
    if not cfg.lora.enable_lora:
        return None
    dtype = model.dtype if cfg.lora.lora_dtype == "auto" else getattr(torch, cfg.lora.lora_dtype)
    slots = LoraSlots(model_shape(model), model.kern, max_rank=cfg.lora.max_lora_rank,
                      max_cached=cfg.lora.max_cpu_loras or cfg.lora.max_loras, dtype=dtype, device=device)
    attach(model, slots)
    return slots
