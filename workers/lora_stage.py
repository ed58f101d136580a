"""A LoRA adapter as the target of one weight update (SkyRL's in-memory LoRA sync, engine.trainer's send_lora):
the trainer pushes the adapter's PEFT tensors through the ordinary transfer (ipc / collective, the same
start -> update_weights -> finish -> commit, all or nothing), and the worker builds the adapter version from
them instead of writing the model.

`LoraStage` stands in for the model in engine.weights.receiver while armed: it names the destination of each
PEFT tensor (a fresh fp32 buffer of the shape the adapter's rank and the model imply; anything else is a 400
naming the tensor), checks at finish that every A has its B, and at commit hands the tensors to the worker's
LoraSlots (workers/lora.py), which builds the version at once. An abort drops it; the version that was
serving keeps serving.
"""

from __future__ import annotations

import torch

from bus.messages import LoraTargetCall
from engine.lora import AdapterFactors, LoraError, adapter_spec, lora_key, lora_shape
from engine.weights.protocol import WeightSyncError


class LoraStage:
    def __init__(self, target: LoraTargetCall, hf_config: dict, slots):
        self.target, self.hf, self.slots = target, hf_config, slots
        self.tensors: dict[str, torch.Tensor] = {}
        self.factors = AdapterFactors(target.rank, target.scaling, dict(target.experts))

    def _fail(self, why: str, param: str = "names") -> WeightSyncError:
        return WeightSyncError(f"LoRA adapter {self.target.lora_name!r}: {why}", status=400, param=param)

    def _shape(self, name: str) -> torch.Size:
        parsed = lora_key(name, self.hf, self.factors.experts)
        if parsed is None:
            experts = f", the experts' {'/'.join(self.factors.experts)}" if self.factors.experts else ""
            raise self._fail(f"{name!r} is not a LoRA A/B of a target projection of layers 0..."
                             f"{self.hf['num_hidden_layers'] - 1} (q/k/v/o_proj, gate/up/down_proj in a dense "
                             f"layer{experts}; PEFT names: base_model.model.model.layers.N.self_attn.q_proj."
                             "lora_A.weight)")
        if name in self.target.aliases:
            raise self._fail(f"{name!r} was sent and is also an alias of {self.target.aliases[name]!r}")
        return torch.Size(lora_shape(self.factors, parsed[1], parsed[2], self.hf))

    # what engine.weights.receiver asks of its model
    def weight_destination(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = self.tensors[name] = torch.empty(self._shape(name), dtype=torch.float32)
        return t

    def weight_full_shape(self, name: str) -> torch.Size:
        return self._shape(name)

    def weight_source(self, name: str, src: torch.Tensor) -> torch.Tensor:
        return src  # kept whole: each rank takes its slice when it builds the version (workers.lora.tp_cuts)

    def finish(self) -> None:
        """Every A with its B, aliases resolved: the checks of a folder's adapter (400 naming the cause)."""
        for public, sent in self.target.aliases.items():
            if sent not in self.tensors:
                raise self._fail(f"alias {public!r} refers to {sent!r}, which was not received", "aliases")
            known = lora_key(public, self.hf, self.factors.experts) is not None
            if not known or self.tensors[sent].shape != self._shape(public):
                raise self._fail(f"alias {public!r} does not name a tensor of {sent!r}'s shape", "aliases")
            self.tensors[public] = self.tensors[sent]
        try:
            self.spec = adapter_spec(self.target.lora_name, self.factors,
                                     {k: list(t.shape) for k, t in self.tensors.items()}, self.hf, "the update")
        except LoraError as e:
            raise WeightSyncError(str(e), status=400, param="names") from None

    def commit(self) -> None:
        t = self.target
        self.slots.put_memory(t.lora_id, t.version, t.lora_name, self.tensors, self.spec)
