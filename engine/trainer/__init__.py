"""The trainers' client library: what a training process imports to push weights into a running rollbus
engine. It imports only the wire protocol and the device layer, never the server's modules.

    from engine.trainer import WeightSyncClient, WeightSyncFailed, weight_checksums
    from engine.trainer import use_engine_kernels   # training consistency (docs/batch-invariance.md)

See docs/weight-sync.md. The implementation lives in engine/trainer/client.py and consistency.py.
"""

from engine.trainer.client import PAUSE_MODES, WeightSyncClient, WeightSyncFailed, weight_checksums
from engine.trainer.consistency import use_engine_kernels

__all__ = ["PAUSE_MODES", "WeightSyncClient", "WeightSyncFailed", "use_engine_kernels", "weight_checksums"]
