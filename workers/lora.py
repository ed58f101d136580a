"""LoRA on the worker: the adapter versions it holds, and the grouped LoRA product of a mixed step.

Each sequence runs with one adapter version for its whole life (bus.sampling_params.LoraRef: id and
version). `LoraSlots` keeps the loaded versions keyed by (id, version) with a count of the sequences using
each; an idle one is dropped least recently used first beyond `max_cached` (--max-cpu-loras), and read again
from its folder when a sequence needs it. An in-place reload is a new version: sequences that started on
the old one keep it to their end, so no sequence ever mixes two versions; an old version that was dropped
cannot be read again (its folder holds the new weights), so a sequence that needs it then (a recompute after
preemption) fails alone, naming it, rather than mixing.

The product (vLLM's punica kernels do the same on GPUs, segmented by adapter): before a forward,
`begin_step` lays the step's adapter rows out grouped by adapter (one index tensor, each adapter a span of
it); each hooked projection (q/k/v, o, gate/up, down in workers/models/llama.py: one fused A/B per fused
base weight) then adds every adapter row's B·(A·x)·scaling. On CPU that is one call of ascend_ops's
`lora_add` kernel per projection for all adapters (rows gathered, shrunk, expanded and added inside it;
B packed in panels, the zero blocks of q/k/v and gate/up never read); elsewhere (or ROLLBUS_CPU_KERNELS=0)
one gather, per adapter two of the model's `kern.linear` on its contiguous span, one scatter-add. Base rows
and steps without adapters cost nothing. Either way a row's delta depends on its own input and its
adapter's weights only, so a row's bits do not depend on its batch-mates whenever the base product's do not
(docs/batch-invariance.md). Measured: bench/lora_decode.py (docs/lora.md).

MoE experts (PEFT's target_parameters on the stacked gate_up_proj / down_proj): each adapter version holds
one Pair per expert; SparseMoE's moe_experts calls `expert_hook` after each routed expert's base products,
and the hook adds that expert's delta to its rows, grouped by adapter, with the same kernel (or linears).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch

from ascend_ops import cpu_kernels
from bus.sampling_params import LoraRef
from engine.lora import (
    EXPERT,
    MEMORY_PREFIX,
    AdapterSpec,
    LoraError,
    expert_dims,
    expert_key,
    inspect_adapter,
    is_moe,
    module_features,
)
from workers.models.moe import SparseMoE

Key = tuple[int, int]  # (adapter id, version)
# fused projection of the decoder -> its PEFT parts, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


class Pair(NamedTuple):
    """One adapter's product on one fused projection: the targeted parts' A stacked [K*r, in]; their B·scaling
    placed block-diagonally, as B [fused out, K*r] for the model's linear (the torch path) or as B^T
    [K*r, fused out] with each block's columns `ranges` [K, 2] for the CPU kernel (which skips the zeros)."""

    a: torch.Tensor
    b: torch.Tensor | None
    bt: torch.Tensor | None
    ranges: torch.Tensor | None


class AdapterWeights:
    """One adapter version on the device: per layer, per fused projection (qkv, o, gate_up, down), one Pair, so
    a group's delta on a fused projection is two GEMMs and one add, or one kernel call for all groups."""

    def __init__(self, tensors: dict[str, torch.Tensor], spec: AdapterSpec, hf_config: dict, dtype: torch.dtype,
                 device: torch.device, kernel: bool, cuts: Cuts | None = None,
                 built: dict[tuple[int, str], Pair] | None = None):
        """`built`: (layer, fused) -> a Pair already in the kernel's layout (a push written straight into it,
        workers/lora_stage.py); every other targeted projection is built from `tensors`."""
        cuts, built = cuts or {}, built or {}
        # this rank's out features of each part (column-parallel parts are cut by output)
        feats = {m: cuts.get((m, "B"), (0, out))[1] for m, (_, out) in module_features(hf_config).items()}
        self.layers: list[dict[str, Pair]] = [{} for _ in range(hf_config["num_hidden_layers"])]
        # expert LoRA: per layer, per stacked expert parameter (gate_up_proj, down_proj), one Pair per expert
        self.experts: list[dict[str, list[Pair]]] = [{} for _ in self.layers]
        targeted = set(spec.modules)
        for layer, module in spec.modules:
            if module.startswith(EXPERT):
                self.experts[layer][module[len(EXPERT):]] = _expert_pairs(
                    tensors, layer, module[len(EXPERT):], spec, hf_config, dtype, device, kernel, cuts)
        for layer in range(len(self.layers)):
            for fused, parts in FUSED.items():
                mine = [m for m in parts if (layer, m) in targeted]
                if (layer, fused) in built:
                    self.layers[layer][fused] = built[(layer, fused)]
                    continue
                if not mine:
                    continue
                block = "self_attn" if fused in ("qkv", "o") else "mlp"
                stem = f"base_model.model.model.layers.{layer}.{block}"
                a = torch.cat([_cut(tensors[f"{stem}.{m}.lora_A.weight"], (m, "A"), cuts) for m in mine])  # [K*r, in]
                bs, ranges, row = [], [], 0  # each targeted part's B [out, r] and its rows of the fused output
                for m in parts:
                    if m in mine:
                        bs.append(_cut(tensors[f"{stem}.{m}.lora_B.weight"], (m, "B"), cuts))
                        ranges.append((row, row + feats[m]))
                    row += feats[m]
                if kernel:
                    self.layers[layer][fused] = Pair(_on(a, device, dtype), None,
                                                     _on(_panels(bs, spec.scaling), device, dtype),
                                                     torch.tensor(ranges, dtype=torch.long))
                else:
                    b = torch.zeros(row, len(mine) * spec.rank)  # block-diagonal: part k's B on its rows only
                    for k, (part, (r0, r1)) in enumerate(zip(bs, ranges)):
                        b[r0:r1, k * spec.rank:(k + 1) * spec.rank] = part * spec.scaling
                    self.layers[layer][fused] = Pair(_param(a, device, dtype), _param(b, device, dtype), None, None)

    def nbytes(self) -> int:
        pairs = [p for layer in self.layers for p in layer.values()]
        pairs += [p for layer in self.experts for per_expert in layer.values() for p in per_expert]
        return sum(t.numel() * t.element_size() for p in pairs for t in (p.a, p.b, p.bt) if t is not None)

    @classmethod
    def from_folder(cls, ref: LoraRef, hf_config: dict, max_rank: int, dtype: torch.dtype, device: torch.device,
                    kernel: bool, cuts: Cuts | None = None) -> AdapterWeights:
        from safetensors.torch import load_file

        spec = inspect_adapter(ref.name, ref.path, hf_config, max_rank)
        tensors = load_file(str(Path(ref.path) / "adapter_model.safetensors"))
        return cls(tensors, spec, hf_config, dtype, device, kernel, cuts)


def _expert_pairs(tensors: dict[str, torch.Tensor], layer: int, param: str, spec: AdapterSpec, hf: dict,
                  dtype: torch.dtype, device: torch.device, kernel: bool, cuts: Cuts) -> list[Pair]:
    """Each expert's A [r, in] and B·scaling of one stacked expert parameter (PEFT's ParamWrapper layout: A
    [E*r, in] with expert e's rows e*r.., B [out, r*E] with expert e's columns e, e+E, ...). With tensor
    parallelism each rank keeps its intermediate slice as the experts' weights do: gate_up_proj's B rows of
    this rank's gate rows and up rows, down_proj's A columns."""
    experts, _, inter = expert_dims(hf)
    rank, scaling = spec.factors.experts[param]
    a = tensors[expert_key(layer, param, spec.factors.experts, "A")].view(experts, rank, -1)  # [E, r, in]
    b = tensors[expert_key(layer, param, spec.factors.experts, "B")]
    b = b.view(b.shape[0], rank, experts).permute(2, 0, 1)  # [E, out, r]
    if ("experts", "I") in cuts:
        lo, n = cuts[("experts", "I")]
        if param == "gate_up_proj":
            b = torch.cat([b[:, lo:lo + n], b[:, inter + lo:inter + lo + n]], dim=1)
        else:
            a = a[:, :, lo:lo + n]
    b = b.contiguous()
    ranges = torch.tensor([[0, b.shape[1]]], dtype=torch.long)
    if kernel:
        return [Pair(_on(a[e], device, dtype), None, _on(_panels([b[e]], scaling), device, dtype), ranges)
                for e in range(experts)]
    return [Pair(_param(a[e], device, dtype), _param(b[e] * scaling, device, dtype), None, None)
            for e in range(experts)]


# (PEFT module, "A" or "B") -> (first, count): this tensor-parallel rank's slice of it, as vLLM splits LoRA:
# column-parallel projections (q/k/v, gate/up) keep B's rows of this rank's outputs (A whole); row-parallel
# ones (o, down) keep A's columns of this rank's inputs (B whole), and their partial delta joins the partial
# product before its all-reduce, so the sum over ranks is B·(A·x). Empty with one rank.
Cuts = dict[tuple[str, str], tuple[int, int]]


def tp_cuts(model) -> Cuts:
    """The slices of this worker's part of the model (workers.models.tp_layout's Shard)."""
    sh, d = model.shard, model.cfg.head_dim
    if sh.size == 1:
        return {}
    q, kv, i = (sh.q0 * d, sh.hq * d), (sh.k0 * d, sh.hk * d), sh.rows(model.cfg.intermediate_size)
    cuts = {("q_proj", "B"): q, ("k_proj", "B"): kv, ("v_proj", "B"): kv, ("o_proj", "A"): q,
            ("gate_proj", "B"): i, ("up_proj", "B"): i, ("down_proj", "A"): i}
    if getattr(model.cfg, "sparse_layers", ()):  # every expert's intermediate rows of this rank (SparseMoE's)
        e_i = model.cfg.moe_intermediate_size // sh.size
        cuts[("experts", "I")] = (sh.rank * e_i, e_i)
    return cuts


def _cut(t: torch.Tensor, key: tuple[str, str], cuts: Cuts) -> torch.Tensor:
    if key not in cuts:
        return t
    lo, n = cuts[key]
    return t[lo:lo + n] if key[1] == "B" else t[:, lo:lo + n]


PANEL = 32  # ascend_ops/csrc/cpu_lora.cpp's kPanel


def _panels(bs: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """B^T·scaling of each targeted part (its B [out, r]) in the kernel's layout: part after part,
    [panels][rank][PANEL] (the last panel zero-padded), flattened. One strided multiply per part into the
    packed buffer: no dense block-diagonal B, no temporary (an in-place reload builds this on its path)."""
    rank = bs[0].shape[1]
    sizes = [-(-b.shape[0] // PANEL) * PANEL * rank for b in bs]
    out = torch.empty(sum(sizes), dtype=torch.float32)
    for b, chunk in zip(bs, out.split(sizes)):
        b, width = b.float(), b.shape[0]
        panels = chunk.view(-1, rank, PANEL)  # [P, r, PANEL]
        if width % PANEL:
            panels[-1].zero_()
        full = width // PANEL * PANEL
        torch.mul(b[:full].view(-1, PANEL, rank).transpose(1, 2), scaling, out=panels[:full // PANEL])
        if full < width:
            torch.mul(b[full:].t(), scaling, out=panels[-1, :, :width - full])
    return out


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


def _param(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.nn.Parameter:
    """A parameter, so the model's linear multiplies on a packed copy made once (ascend_ops.packed_linear:
    plain tensors are repacked by F.linear on every call, which measured as most of the LoRA product's cost)."""
    return torch.nn.Parameter(_on(t, device, dtype), requires_grad=False)


_NONE = torch.empty(0)  # the kernel's placeholder for an adapter that does not target a projection
_NO_RANGES = torch.empty(0, 2, dtype=torch.long)


class LoraSlots:
    def __init__(self, hf_config: dict, kern, *, max_rank: int, max_cached: int, dtype: torch.dtype,
                 device: torch.device, kernel: bool = True, cuts: Cuts | None = None):
        self.hf_config, self.kern, self.cuts = hf_config, kern, cuts or {}
        self.moe = is_moe(hf_config)
        self.max_rank, self.max_cached, self.dtype, self.device = max_rank, max_cached, dtype, device
        self.loaded: OrderedDict[Key, AdapterWeights] = OrderedDict()  # least recently used first
        self.users: dict[Key, int] = {}
        self.newest: dict[int, int] = {}  # adapter id -> the latest version this worker loaded
        # adapter id -> (version, name, weights) of the last version a trainer pushed (workers/lora_stage.py),
        # kept to serve it again after an eviction until discarded (SkyRL's skyrl_discard_in_memory_lora) or a
        # level-2 sleep
        self.memory: dict[int, tuple[int, str, AdapterWeights]] = {}
        self.spans: list[tuple[int, int, AdapterWeights]] = []  # this step's adapters: (lo, hi) of perm's rows
        self.perm: torch.Tensor | None = None  # this step's adapter rows, grouped by adapter
        self.in_order = False
        # the CPU kernel (ascend_ops/csrc/cpu_lora.cpp): one call per projection for all of a step's adapters
        cpu = kernel and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        self.ops = cpu_kernels.ops() if cpu else None
        self.kernel = self.ops is not None
        self.bounds: torch.Tensor | None = None
        self.row_span = torch.empty(0, dtype=torch.long)  # MoE: this step's rows -> their span (-1: the base)
        self.expert_layers: set[int] = set()

    def load(self, ref: LoraRef) -> AdapterWeights:
        """The weights of this version, read from its folder if not held (raises what the folder's check does)."""
        key = (ref.id, ref.version)
        w = self.loaded.get(key)
        if w is None:
            newest = self.newest.get(ref.id, 0)
            if ref.version < newest:  # its folder holds a later version now: computing with it would mix two
                raise LoraError(f"version {ref.version} of LoRA adapter {ref.name!r} was replaced by version "
                                f"{newest} and is no longer loaded on this worker (raise --max-cpu-loras)")
            if ref.path.startswith(MEMORY_PREFIX):
                version, _, w = self.memory.get(ref.id, (0, "", None))
                if version != ref.version:
                    raise LoraError(f"version {ref.version} of LoRA adapter {ref.name!r} was pushed by a trainer and "
                                    "is no longer held on this worker (discarded or replaced)")
            else:
                w = AdapterWeights.from_folder(ref, self.hf_config, self.max_rank, self.dtype, self.device,
                                               self.kernel, self.cuts)
            self.loaded[key] = w
            self.newest[ref.id] = ref.version
        self.loaded.move_to_end(key)
        self._evict()
        return w

    def put_memory(self, lora_id: int, version: int, name: str, weights: AdapterWeights) -> None:
        """A version a trainer pushed (committed by every worker), built: served from now on, and kept to serve
        again after an eviction."""
        self.memory[lora_id] = (version, name, weights)
        self.load(LoraRef(lora_id, name, MEMORY_PREFIX + name, version))

    def discard_memory(self, lora_id: int) -> bool:
        return self.memory.pop(lora_id, None) is not None

    def sleep_drop(self) -> tuple[int, list[str]]:
        """A level-2 sleep (vLLM's drops the adapters with the weights): every idle version on this worker and
        every pushed adapter's tensors go; versions a (frozen) sequence still uses stay until it ends. Adapters
        from folders are read again when next needed; pushed ones must be pushed again: their names are
        returned, with the bytes freed."""
        dropped = [self.loaded.pop(k) for k in [k for k in self.loaded if k not in self.users]]
        kept = {id(w) for w in self.loaded.values()}  # a pushed version a sequence still uses stays
        dropped += [w for _, _, w in self.memory.values() if id(w) not in kept]
        freed = sum(w.nbytes() for w in {id(w): w for w in dropped}.values())
        names = sorted(name for _, name, _ in self.memory.values())
        self.memory.clear()
        return freed, names

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
        """Lay out this step's token rows by adapter (None: the base model): the adapter rows in one order that
        puts each adapter's rows together (`perm`, the one gather every hooked projection makes), and each
        adapter's span of it. A step without adapter rows costs the projections nothing."""
        by_key: dict[Key, list[int]] = {}
        for i, k in enumerate(row_keys):
            if k is not None:
                by_key.setdefault(k, []).append(i)
        order = [i for rows in by_key.values() for i in rows]
        self.spans, lo = [], 0
        for k, rows in by_key.items():
            self.spans.append((lo, lo + len(rows), self.loaded[k]))
            lo += len(rows)
        # all rows, already grouped: no gather and no scatter (a plain add)
        self.in_order = len(order) == len(row_keys) and order == list(range(len(order)))
        self.perm = torch.tensor(order, dtype=torch.long, device=self.device) if order else None
        self.bounds = torch.tensor([0, *(hi for _, hi, _ in self.spans)], dtype=torch.long)
        # the layers whose experts this step's adapters target (the others' expert hooks return at once)
        self.expert_layers = {i for _, _, w in self.spans for i, e in enumerate(w.experts) if e} if self.moe else set()
        if self.expert_layers:  # each row's adapter (its span's index; -1: the base), for the experts' hooks
            self.row_span = torch.full((len(row_keys),), -1, dtype=torch.long, device=self.device)
            for g, rows in enumerate(by_key.values()):
                self.row_span[rows] = g

    def end_step(self) -> None:
        self.spans, self.perm, self.expert_layers = [], None, set()

    def hook(self, layer: int, fused: str):
        """The function a projection calls after its base product: (x, out) -> out with each row's delta."""
        linear = self.kern.linear

        def add_delta(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            perm = self.perm
            if perm is None:
                return out
            if self.kernel:
                pairs = [w.layers[layer].get(fused) for _, _, w in self.spans]
                return self._kernel_add(x, out, perm, self.bounds, pairs)
            xs = (x if self.in_order else x.index_select(0, perm)).to(self.dtype)  # adapter rows, grouped
            deltas = []
            for lo, hi, w in self.spans:  # per adapter: B·(A·x) on its rows, a contiguous slice
                p = w.layers[layer].get(fused)
                deltas.append(xs.new_zeros(hi - lo, out.shape[1]) if p is None else linear(linear(xs[lo:hi], p.a), p.b))
            delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas)).to(out.dtype)
            # each row gets its own delta once (rows distinct): out[r] + delta[r], whatever the batch
            return out.add_(delta) if self.in_order else out.index_add_(0, perm, delta)

        return add_delta

    def _kernel_add(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, bounds: torch.Tensor,
                    pairs: list[Pair | None]) -> torch.Tensor:
        """One lora_add call: out[rows of group g] += each group's delta (pairs[g]; None: not targeted)."""
        args = (rows, bounds, [p.a if p else _NONE for p in pairs], [p.bt if p else _NONE for p in pairs],
                [p.ranges if p else _NO_RANGES for p in pairs])
        if x.dtype == out.dtype == self.dtype and x.is_contiguous() and out.is_contiguous():
            self.ops.lora_add(out, x, *args)
            return out
        delta = torch.zeros(out.shape, dtype=self.dtype)  # --lora-dtype other than the model's
        self.ops.lora_add(delta, x.to(self.dtype).contiguous(), *args)
        return out.add_(delta.to(out.dtype))

    def expert_hook(self, layer: int):
        """The function SparseMoE's experts call after each expert's base product (ascend_ops.ops.moe_experts):
        (param, expert, tokens, x, out) -> out with each adapter row's delta of that expert, the rows of one
        adapter grouped (x, out: the expert's rows; tokens: each row's token in the step)."""
        linear = self.kern.linear

        def add_expert_delta(param: str, expert: int, tokens: torch.Tensor, x: torch.Tensor,
                             out: torch.Tensor) -> torch.Tensor:
            if layer not in self.expert_layers:
                return out
            groups = self.row_span.index_select(0, tokens)
            rows = (groups >= 0).nonzero().squeeze(1)
            if rows.numel() == 0:
                return out
            g = groups.index_select(0, rows)
            order = torch.argsort(g, stable=True)  # each adapter's rows together, in the step's order
            rows, g = rows.index_select(0, order), g.index_select(0, order)
            counts = torch.bincount(g, minlength=len(self.spans)).tolist()
            pairs = []
            for _, _, w in self.spans:
                per_expert = w.experts[layer].get(param)
                pairs.append(per_expert[expert] if per_expert else None)
            if self.kernel:
                bounds = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.long)
                return self._kernel_add(x.contiguous(), out, rows, bounds, pairs)
            lo = 0
            for n, p in zip(counts, pairs):
                if n and p is not None:
                    idx = rows[lo:lo + n]
                    delta = linear(linear(x.index_select(0, idx).to(self.dtype), p.a), p.b)
                    out.index_add_(0, idx, delta.to(out.dtype))
                lo += n
            return out

        return add_expert_delta


def attach(model, slots: LoraSlots) -> None:
    """Give every decoder layer's projections their LoRA hook (workers/models/llama.py calls them)."""
    if getattr(model, "state_spec", None) is not None:
        raise NotImplementedError("--enable-lora: adapters on a hybrid linear-attention model (Gated DeltaNet) are "
                                  "not implemented; serve this model without --enable-lora")
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):
            raise NotImplementedError("--enable-lora: adapters on multi-head latent attention are not implemented")
        attn.lora_qkv, attn.lora_o = slots.hook(i, "qkv"), slots.hook(i, "o")
        if hasattr(mlp, "gate_up_proj"):  # a dense MLP (an MoE model's dense layers too)
            mlp.lora_gate_up, mlp.lora_down = slots.hook(i, "gate_up"), slots.hook(i, "down")
        elif type(mlp) is SparseMoE:  # the experts' stacked projections (PEFT's target_parameters)
            mlp.lora_experts = slots.expert_hook(i)


def model_shape(model) -> dict:
    """The config keys engine.lora's checks read, from the built decoder."""
    c = model.cfg
    shape = {"hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
             "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers}
    if getattr(c, "sparse_layers", ()):  # engine.lora.targets / expert_dims
        shape.update(num_local_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
                     sparse_layers=list(c.sparse_layers), architectures=[c.architecture])
    return shape


def slots_for(cfg, model, device: torch.device) -> LoraSlots | None:
    """The worker's adapter slots with --enable-lora (hooked into the model), else None."""
    if not cfg.lora.enable_lora:
        return None
    dtype = model.dtype if cfg.lora.lora_dtype == "auto" else getattr(torch, cfg.lora.lora_dtype)
    slots = LoraSlots(model_shape(model), model.kern, max_rank=cfg.lora.max_lora_rank,
                      max_cached=cfg.lora.max_cpu_loras or cfg.lora.max_loras, dtype=dtype, device=device,
                      cuts=tp_cuts(model))
    attach(model, slots)
    return slots
