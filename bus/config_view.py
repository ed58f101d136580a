"""How bus/ reads the engine's config without importing engine (the import floors): a field of one of its
sub-configs (EngineConfig.bus, .parallel, .gateway, ...), or the default a bare config has where the object
given has no such field (Endpoints.from_url passes a namespace with only an ipc folder)."""

from __future__ import annotations

from typing import Any


def setting(cfg: Any, sub: str, name: str, default: Any) -> Any:
    """cfg.<sub>.<name>, or `default` where cfg has no such sub-config or field."""
    return getattr(getattr(cfg, sub, None), name, default)
