"""What reading vLLM's pickled IPC handles safely costs: rollbus's restricted unpickler plus the per-field checks
(engine.weights.ipc) against plain pickle.loads (what vLLM's worker runs), on the handles vLLM's HTTP client makes for
a CPU trainer holding SmolLM2-135M in bf16 (reduce_tensor per tensor, pickled: the data travels inline).
Ratio of medians over 5 alternating rounds.

    PYTHONPATH=$PWD python bench/pickled_handles.py
"""

from __future__ import annotations

import base64
import pickle
import statistics
import time
import warnings

import torch
from torch.multiprocessing.reductions import reduce_tensor

from engine.model_store import resolve_model
from engine.weights import ipc_pickled as ph  # vLLM's pickled handles
from workers.models.checkpoint import iter_safetensors

warnings.simplefilter("ignore")  # TypedStorage deprecation, from reduce_tensor
tensors = [(n, t.to(torch.bfloat16).contiguous()) for n, t in iter_safetensors(resolve_model(None, progress=False))]
handles = [{"host": reduce_tensor(t)[1]} for _, t in tensors]
text = base64.b64encode(pickle.dumps(handles)).decode()
nbytes = sum(t.numel() * 2 for _, t in tensors)


def ours():
    obj = ph.load_pickled_handles(text)
    return [ph.resolve_pickled_handle(h, ph.Expect(torch.bfloat16, tuple(t.shape)), torch.device("cpu"), "b")
            for h, (_, t) in zip(obj, tensors)]


def vllm():
    return pickle.loads(base64.b64decode(text))



def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


a, b = [], []
for _ in range(5):
    a.append(timed(ours))
    b.append(timed(vllm))
ma, mb = statistics.median(a), statistics.median(b)
print(f"{len(tensors)} tensors, {nbytes / 2**20:.0f} MiB bf16: restricted+checked {ma * 1e3:.0f} ms, "
      f"pickle.loads {mb * 1e3:.0f} ms, ratio {ma / mb:.2f}")
