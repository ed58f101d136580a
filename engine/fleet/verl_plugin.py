"""verl's plugin hook for rollbus: `import verl` loads every `verl.plugins` entry point (verl 0.9.1,
verl/__init__.py; VERL_USE_EXTERNAL_PLUGINS=none turns that off), and rollbus's pyproject names this module,
so `pip install rollbus[verl]` makes `actor_rollout_ref.rollout.name=rollbus` a rollout backend.

Importing it registers the replica (engine.fleet.verl_replica.RollbusReplica) and the server adapter
(engine.fleet.verl_weights.RollbusServerAdapter) lazily: neither module is imported until verl asks for
the backend. The checkpoint engine is named in verl's config
(`checkpoint_engine.backend=rollbus checkpoint_engine.custom_backend_module=engine.fleet.verl_weights`).
verl swallows a failing plugin (a debug log line only); `python -m engine.fleet.verl_plugin` says whether
the registration worked.
"""

from __future__ import annotations

NAME = "rollbus"
ADAPTER = "engine.fleet.verl_weights.RollbusServerAdapter"


def _load_replica() -> type:
    from engine.fleet.verl_replica import RollbusReplica

    return RollbusReplica


def register() -> None:
    from verl.workers.rollout import base, replica

    replica.RolloutReplicaRegistry.register(NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER


register()


if __name__ == "__main__":
    import verl  # noqa: F401  (loads the entry points)
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    print(get_rollout_replica_class(NAME).__name__, get_rollout_class(NAME).__name__)
