"""`--worker-extension-cls module.Class`: vLLM's way for RL frameworks (verl, SkyRL, OpenRLHF, TRL) to add
methods to every worker, callable through POST /collective_rpc.

As vLLM's WorkerWrapperBase.init_worker: the class is imported by its qualified name, every attribute it
defines (dunder names aside) must be new to the worker class (a clash is a start-up error naming both),
and it joins the worker's bases, so its methods run with `self` the worker. Its optional hooks
`init_worker_extension(worker)` (after the model is loaded) and `destroy_worker_extension(worker)` (at
shutdown) are called as vLLM calls them.

Extensions written for vLLM read a few worker attributes; the composed class provides them under vLLM's
names: `model_runner` (its `.model.load_weights(weights=[(name, tensor), ...])` loads in place),
`device`, `rank`, `local_rank`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from typing import Any

HOOKS = ("init_worker_extension", "destroy_worker_extension")
_QUALNAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+")


class WorkerExtensionError(ValueError):
    pass


def check_qualname(qualname: str) -> None:
    """Start-up check without importing the user's module: the name's form, and that its module exists."""
    if not qualname:
        return
    if not _QUALNAME.fullmatch(qualname):
        raise WorkerExtensionError(f"--worker-extension-cls {qualname!r} must be a qualified name: module.Class")
    module = qualname.rsplit(".", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        found, why = None, f": {e}"
    else:
        why = ""
    if found is None:
        raise WorkerExtensionError(f"--worker-extension-cls {qualname}: module {module!r} cannot be found{why}")


def resolve_extension(qualname: str) -> type:
    """Import module.Class (vLLM's resolve_obj_by_qualname); errors name the flag and the path."""
    check_qualname(qualname)
    module_name, cls_name = qualname.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module failed to import; say so by name
        raise WorkerExtensionError(f"--worker-extension-cls {qualname}: importing {module_name} failed: "
                                   f"{type(e).__name__}: {e}") from e
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise WorkerExtensionError(f"--worker-extension-cls {qualname}: {module_name} has no class {cls_name}")
    return cls


def public_methods(ext: type) -> list[str]:
    """The methods /collective_rpc may call: callables whose names do not start with '_', hooks aside."""
    return sorted(a for a in dir(ext) if not a.startswith("_") and a not in HOOKS and callable(getattr(ext, a)))


class _Alias:
    """A read-only alias of a worker attribute (a non-data descriptor: if the worker ever sets the
    name itself, its own value wins)."""

    def __init__(self, path: str):
        self.path = path.split(".")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        for part in self.path:
            obj = getattr(obj, part)
        return obj


# vLLM Worker attribute names extensions read, over the rollbus worker's own.
VLLM_WORKER_NAMES = {"model_runner": _Alias("runner"), "device": _Alias("runner.device"),
                     "local_rank": _Alias("rank")}


def extend_worker_class(worker_cls: type, qualname: str) -> type:
    """The worker class with the extension mixed in (or worker_cls itself when there is none)."""
    if not qualname:
        return worker_cls
    ext = resolve_extension(qualname)
    base = type(worker_cls.__name__, (worker_cls,), {"__module__": worker_cls.__module__, **VLLM_WORKER_NAMES})
    for attr in dir(ext):
        if attr.startswith("__"):
            continue
        if hasattr(base, attr):
            raise WorkerExtensionError(f"Worker class {worker_cls.__name__} already has an attribute {attr}, "
                                       f"which conflicts with the worker extension class {qualname}")
    return type(worker_cls.__name__, (base, ext), {"__module__": worker_cls.__module__,
                                                   "worker_extension_cls": ext})


def call_hook(worker: Any, name: str) -> None:
    ext = getattr(type(worker), "worker_extension_cls", None)
    hook = getattr(ext, name, None) if ext is not None else None
    if callable(hook):
        hook(worker)


def extension_methods(worker: Any) -> list[str]:
    ext = getattr(type(worker), "worker_extension_cls", None)
    return public_methods(ext) if ext is not None else []


def call_extension(worker: Any, method: str, args: list, kwargs: dict) -> Any:
    """Run an extension method on this worker; the result as vLLM's route returns it (None, dicts and lists
    kept, anything else as its str)."""
    if method not in extension_methods(worker):
        raise WorkerExtensionError(f"method {method!r} is not a public method of --worker-extension-cls")
    result = getattr(worker, method)(*args, **kwargs)
    if result is None or isinstance(result, (dict, list)):
        try:  # it must cross the bus and become JSON: say so here rather than fail in the socket layer
            json.dumps(result)
        except (TypeError, ValueError) as e:
            raise WorkerExtensionError(f"{method} returned a {type(result).__name__} that is not JSON: {e}") from None
        return result
    return str(result)
