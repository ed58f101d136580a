"""Runs in rollbus's python (the fleet drivers' venvs lack its dependencies): one fleet weight update of a
tiny model, perturbed by SEED, to every engine URL with WeightSyncClient([urls], backend="gloo") under
VERSION. Prints {"version": ..., "seconds": ...}.

    python tests/fleet/push_update.py MODEL_DIR VERSION SEED URL [URL ...]
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from engine.trainer import WeightSyncClient

model_dir, label, seed, urls = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
g = torch.Generator().manual_seed(seed)
with torch.no_grad():
    for p in trainer.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
t0 = time.monotonic()
with WeightSyncClient(urls, backend="gloo") as client:
    client.send_weights(trainer.named_parameters(), version=label)
print(json.dumps({"version": label, "seconds": round(time.monotonic() - t0, 2)}))
