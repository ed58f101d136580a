"""Compatibility shim for SkyRL 0.4 gaps that every rollbus user of SkyRL's inference-server layer hits
(SkyRL's, not rollbus's; remove once a SkyRL release fixes them). Call `apply()` once in the driver,
before importing SkyRL's ServerGroup or VLLMRouter:

1. `ServerGroup.__init__` imports `vllm_server_actor` (and so all of vLLM) even when another
   `server_actor_cls` is given: without vLLM installed it raises ImportError. The shim registers a stand-in
   module for `skyrl...inference_servers.vllm_server_actor` when vLLM is absent; its VLLMServerActor raises
   if anything actually tries to use it.
2. SkyRL's `VLLMRouter.start()` reads `RouterArgs.pd_disaggregation`, which vllm-router 0.1.17 lacks (it has
   `vllm_pd_disaggregation`): AttributeError after the router started. The shim gives RouterArgs that
   attribute, reading `vllm_pd_disaggregation`.
3. `ServerGroup` creates its server actors without `max_restarts`, so Ray never restarts one whose process
   died, and the engine behind that URL stays gone. The shim makes ServerGroup create an actor class with
   the options the class asks for (`RAY_ACTOR_OPTIONS`: RollbusServerActor's restart it, and the actor
   starts its engine again by itself); a class without them is created exactly as SkyRL does.

Two more gaps need no shim: SkyRL's trainer path (`create_inference_servers`) hard-codes VLLMServerActor, so a
trainer uses rollbus through `external_server_urls` or its `_get_new_inference_client` hook (docs/fleet.md);
and its client's `/skyrl/v1/generate` (routed experts) is served by rollbus's gateway.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

VLLM_SERVER_ACTOR = "skyrl.backends.skyrl_train.inference_servers.vllm_server_actor"


def stub_vllm_server_actor() -> bool:
    """Bug 1. True when the stand-in was installed (vLLM absent and the real module not imported yet)."""
    if VLLM_SERVER_ACTOR in sys.modules or importlib.util.find_spec("vllm") is not None:
        return False
    mod = types.ModuleType(VLLM_SERVER_ACTOR)
    mod.__doc__ = "Stand-in installed by engine.fleet.skyrl_compat: vLLM is not installed."

    class VLLMServerActor:  # noqa: D401 - a placeholder
        def __init__(self, *args, **kwargs):
            raise RuntimeError("SkyRL's VLLMServerActor needs vLLM, which is not installed; pass "
                               "server_actor_cls=engine.fleet.skyrl_actor.RollbusServerActor")

        @staticmethod
        def compute_num_gpus_per_server(cli_args) -> int:
            raise RuntimeError("SkyRL's VLLMServerActor needs vLLM, which is not installed")

    mod.VLLMServerActor = VLLMServerActor
    sys.modules[VLLM_SERVER_ACTOR] = mod
    return True


def router_args_pd_disaggregation() -> bool:
    """Bug 2. True when RouterArgs got the attribute (vllm-router installed and lacking it)."""
    try:
        from vllm_router.router_args import RouterArgs
    except ImportError:
        return False
    if hasattr(RouterArgs, "pd_disaggregation"):
        return False
    RouterArgs.pd_disaggregation = property(lambda self: bool(getattr(self, "vllm_pd_disaggregation", False)))
    return True


SERVER_GROUP = "skyrl.backends.skyrl_train.inference_servers.server_group"


class _RayWithActorOptions:
    """The `ray` module as ServerGroup._create_actor_class sees it while the shim calls it: `ray.remote(cls)`
    becomes `ray.remote(**options)(cls)`, so SkyRL's own `.options(...)` (placement, runtime env) still
    apply on top; everything else is Ray's."""

    def __init__(self, ray: types.ModuleType, options: dict):
        self._ray, self._options = ray, options

    def remote(self, cls):
        return self._ray.remote(**self._options)(cls)

    def __getattr__(self, name: str):
        return getattr(self._ray, name)


def server_group_actor_options() -> bool:
    """Gap 3. True when ServerGroup was patched (SkyRL importable, and not patched before)."""
    try:
        server_group = importlib.import_module(SERVER_GROUP)
    except ImportError:
        return False
    group_cls = server_group.ServerGroup
    original = group_cls._create_actor_class
    if getattr(original, "_rollbus_actor_options", False):
        return False

    def _create_actor_class(self, pg, start_bundle_idx):
        options = getattr(self._server_actor_cls, "RAY_ACTOR_OPTIONS", None)
        if not options:
            return original(self, pg, start_bundle_idx)
        ray = server_group.ray
        server_group.ray = _RayWithActorOptions(ray, dict(options))
        try:
            return original(self, pg, start_bundle_idx)
        finally:
            server_group.ray = ray

    _create_actor_class._rollbus_actor_options = True
    group_cls._create_actor_class = _create_actor_class
    return True


def apply() -> dict[str, bool]:
    """Every workaround; says which were needed. Gap 3 imports SkyRL's ServerGroup module, after gap 1's
    stand-in is in place."""
    return {"vllm_server_actor_stub": stub_vllm_server_actor(),
            "router_args_pd_disaggregation": router_args_pd_disaggregation(),
            "server_group_actor_options": server_group_actor_options()}
