"""Worker extensions for the --worker-extension-cls tests, written as RL frameworks write them for vLLM:
methods that read `self.model_runner.model`, `self.device` and `self.rank`."""

from __future__ import annotations

import torch


class ChecksumExtension:
    def init_worker_extension(self) -> None:
        self.extension_ready = True

    def param_checksum(self, name: str) -> dict:
        """float64 sum and the first values of one parameter, for comparison with a local copy."""
        p = dict(self.model_runner.model.named_parameters())[name]
        flat = p.detach().reshape(-1).to("cpu", torch.float64)
        return {"sum": float(flat.sum()), "head": [float(x) for x in flat[:4]], "rank": self.local_rank,
                "device": str(self.device), "ready": getattr(self, "extension_ready", False)}

    def fill_param(self, name: str, value: str) -> None:
        """Load one tensor the way vLLM extensions do (model.load_weights(weights=[(name, tensor)]))."""
        p = dict(self.model_runner.model.named_parameters())[name]
        self.model_runner.model.load_weights(weights=[(name, torch.full_like(p, float(value)))])

    def tensor_dict(self) -> dict:
        return {"t": torch.zeros(2)}  # not JSON: the call fails with a message, the worker goes on

    def count(self) -> int:
        return 3  # vLLM's route turns a result that is no dict, list or None into its str


class CollidingExtension:
    def start(self) -> None:  # the worker's own start()
        pass


class NotAClass:  # placeholder so the module has something besides the classes above
    pass


not_a_class = 1
