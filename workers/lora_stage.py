"""A LoRA adapter as the target of one weight update (SkyRL's in-memory LoRA sync, engine.trainer's send_lora):
the trainer pushes the adapter's PEFT tensors through the ordinary transfer (ipc / collective, the same
start -> update_weights -> finish -> commit, all or nothing), and the worker builds the adapter version from
them instead of writing the model.

`LoraStage` stands in for the model in engine.weights.receiver while armed: it names the destination of each
PEFT tensor (anything else is a 400 naming the tensor), checks at finish that every A has its B, and at
commit hands the built version to the worker's LoraSlots (workers/lora.py). An abort drops it; the version
that was serving keeps serving.

Written straight into the kernel's layout (the CPU kernel, fp32 adapters, no aliases: an RL trainer's push):
each received A lands in its rows of the fused projection's stacked A, and each B, transposed by the copy
itself, in its part's panels of B^T (workers/lora.py's _panels layout), this rank's slice only; the commit then
scales the panels in place (one thread), so a push costs one copy of the adapter and no build. Anything else (another
dtype, the torch path, aliases, a part whose width is not a whole number of panels, the experts) is kept as
received and built at commit.
"""

from __future__ import annotations

import torch

from ascend_ops.platform import intra_op_threads
from bus.messages import LoraTargetCall
from engine.lora import AdapterFactors, LoraError, lora_key, lora_shape, module_features, paired_spec
from engine.weights.protocol import WeightSyncError
from workers.lora import FUSED, PANEL, AdapterWeights, Pair, _cut

PART_OF = {m: (fused, parts.index(m)) for fused, parts in FUSED.items() for m in parts}


class _Fused:
    """One fused projection's buffers in the kernel's layout, every part's slot allocated (a part the update
    does not send is left out at commit): A [K*r, in] and B^T panels part after part."""

    def __init__(self, parts: tuple[str, ...], rank: int, fin: int, widths: list[int]):
        self.rank, self.widths = rank, widths
        self.a = torch.empty(len(parts) * rank, fin)
        sizes = [w // PANEL * rank * PANEL for w in widths]
        self.bt = torch.empty(sum(sizes))
        self.chunks = list(self.bt.split(sizes))
        self.got: list[set[str]] = [set() for _ in parts]

    def a_rows(self, k: int) -> torch.Tensor:
        return self.a[k * self.rank:(k + 1) * self.rank]

    def b_panels(self, k: int) -> torch.Tensor:
        """Part k's panels [P, r, PANEL] (a received B [width, r] arrives as its transposed view, weight_source)."""
        return self.chunks[k].view(-1, self.rank, PANEL)

    def pair(self, scaling: float, ranges: dict) -> Pair:
        """The kernel's Pair of the parts received (compacted when some part was not sent), B^T scaled; `ranges`
        caches the ranges tensors (the same for every layer)."""
        mine = tuple(k for k, got in enumerate(self.got) if got)
        a, bt = self.a, self.bt
        if len(mine) < len(self.got):
            a = torch.cat([self.a_rows(k) for k in mine])
            bt = torch.cat([self.chunks[k] for k in mine])
        bt.mul_(scaling)  # one rounding of B·scaling, as _panels: a push and its folder give the same bits
        key = (tuple(self.widths), mine)
        if key not in ranges:
            starts = [sum(self.widths[:k]) for k in range(len(self.widths))]
            ranges[key] = torch.tensor([(starts[k], starts[k] + self.widths[k]) for k in mine], dtype=torch.long)
        return Pair(a, None, bt, ranges[key])


class LoraStage:
    def __init__(self, target: LoraTargetCall, hf_config: dict, slots):
        self.target, self.hf, self.slots = target, hf_config, slots
        self.tensors: dict[str, torch.Tensor] = {}  # the tensors kept as received (built at commit)
        self.factors = AdapterFactors(target.rank, target.scaling, dict(target.experts))
        self.direct = slots.kernel and slots.dtype == torch.float32 and not target.aliases
        self.fused: dict[tuple[int, str], _Fused] = {}
        self.parsed: dict[str, tuple[int, str, str, torch.Size]] = {}
        self.shapes: dict[str, list[int]] = {}  # every received name's whole shape
        feats = module_features(hf_config)
        self.width = {m: slots.cuts.get((m, "B"), (0, out))[1] for m, (_, out) in feats.items()}
        self.fin = {m: slots.cuts.get((m, "A"), (0, fin))[1] for m, (fin, _) in feats.items()}

    def _fail(self, why: str, param: str = "names") -> WeightSyncError:
        return WeightSyncError(f"LoRA adapter {self.target.lora_name!r}: {why}", status=400, param=param)

    def _parse(self, name: str, sent: bool = True) -> tuple[int, str, str, torch.Size]:
        """(layer, module, "A" or "B", whole shape) of a PEFT name, read once per name (the receiver asks
        for its shape, destination and source in turn); `sent`: a name the trainer sends (not an alias's)."""
        hit = self.parsed.get(name)
        if hit is None:
            parsed = lora_key(name, self.hf, self.factors.experts)
            if parsed is None:
                experts = f", the experts' {'/'.join(self.factors.experts)}" if self.factors.experts else ""
                raise self._fail(f"{name!r} is not a LoRA A/B of a target projection of layers 0..."
                                 f"{self.hf['num_hidden_layers'] - 1} (q/k/v/o_proj, gate/up/down_proj in a dense "
                                 f"layer{experts}; PEFT names: base_model.model.model.layers.N.self_attn.q_proj."
                                 "lora_A.weight)")
            shape = torch.Size(lora_shape(self.factors, parsed[1], parsed[2], self.hf))
            hit = self.parsed[name] = (*parsed, shape)
        if sent and name in self.target.aliases:
            raise self._fail(f"{name!r} was sent and is also an alias of {self.target.aliases[name]!r}")
        return hit

    def _shape(self, name: str) -> torch.Size:
        return self._parse(name)[3]

    def _in_place(self, module: str) -> bool:
        """Whether this tensor is written straight into the kernel's layout: its fused projection's parts are
        all whole panels wide."""
        return self.direct and module in PART_OF and all(self.width[m] % PANEL == 0
                                                         for m in FUSED[PART_OF[module][0]])

    # what engine.weights.receiver asks of its model
    def weight_destination(self, name: str) -> torch.Tensor:
        layer, module, ab, shape = self._parse(name)
        self.shapes[name] = list(shape)
        if not self._in_place(module):
            t = self.tensors.get(name)
            if t is None:
                t = self.tensors[name] = torch.empty(shape, dtype=torch.float32)
            return t
        fused, k = PART_OF[module]
        f = self.fused.get((layer, fused))
        if f is None:
            parts = FUSED[fused]
            f = self.fused[(layer, fused)] = _Fused(parts, self.factors.rank, self.fin[module],
                                                    [self.width[m] for m in parts])
        f.got[k].add(ab)
        return f.a_rows(k) if ab == "A" else f.b_panels(k)

    def weight_full_shape(self, name: str) -> torch.Size:
        return self._shape(name)

    def weight_source(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A tensor written in place: this rank's slice of it (tp_cuts), a B viewed as its destination's
        [P, PANEL, r]; one kept as received: whole (each rank cuts its slice when it builds the version)."""
        _, module, ab, _ = self._parse(name)
        if not self._in_place(module):
            return src
        part = _cut(src, (module, ab), self.slots.cuts)
        return part if ab == "A" else part.view(-1, PANEL, self.factors.rank).transpose(1, 2)

    def finish(self) -> None:
        """Every A with its B, aliases resolved: the checks of a folder's adapter (400 naming the cause)."""
        for public, sent in self.target.aliases.items():  # (aliases: every tensor kept as received)
            if sent not in self.tensors:
                raise self._fail(f"alias {public!r} refers to {sent!r}, which was not received", "aliases")
            known = lora_key(public, self.hf, self.factors.experts) is not None
            if not known or self.tensors[sent].shape != self._parse(public, sent=False)[3]:
                raise self._fail(f"alias {public!r} does not name a tensor of {sent!r}'s shape", "aliases")
            self.tensors[public] = self.tensors[sent]
            self.shapes[public] = list(self.tensors[sent].shape)
        seen: dict[tuple[int, str], set[str]] = {}
        for name in self.shapes:  # each already parsed and shape-checked when it was received (or aliased)
            layer, module, ab, _ = self._parse(name, sent=False)
            seen.setdefault((layer, module), set()).add(ab)
        try:
            self.spec = paired_spec(self.target.lora_name, self.factors, seen, "the update")
        except LoraError as e:
            raise WeightSyncError(str(e), status=400, param="names") from None

    def commit(self) -> None:
        t, s = self.target, self.slots
        ranges: dict = {}
        with intra_op_threads(1):  # small multiplies: OpenMP's fork-join cost more than them on a loaded host
            built = {key: f.pair(self.factors.scaling, ranges) for key, f in self.fused.items()}
        weights = AdapterWeights(self.tensors, self.spec, self.hf, s.dtype, s.device, s.kernel, s.cuts, built)
        s.put_memory(t.lora_id, t.version, t.lora_name, weights)
