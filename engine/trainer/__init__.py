"""The trainers' client library: what a training process imports to push weights into a running rollbus
engine. It imports only the wire protocol and the device layer, never the server's modules.

    from engine.trainer import WeightSyncClient, WeightSyncFailed, weight_checksums

See docs/weight-sync.md. The implementation lives in engine/trainer/client.py.
"""

from engine.trainer.client import PAUSE_MODES, WeightSyncClient, WeightSyncFailed, weight_checksums

__all__ = ["PAUSE_MODES", "WeightSyncClient", "WeightSyncFailed", "weight_checksums"]
