"""What the engine's processes check about a deployment's layout before they work together: the values every
process must agree on (sent in each Hello), and whether a host has the devices its engines need. The layout
itself (engines, workers, their names and sockets) is bus.topology.
"""

from __future__ import annotations

from bus.messages import Layout
from bus.topology import Topology


def layout(cfg) -> Layout:
    """What every engine process must agree on, sent in its Hello (`info.layout`): the coordinator refuses a
    member whose layout differs from its own (another host started with other flags), naming the value."""
    topo = Topology.from_config(cfg)
    return Layout(cfg.model.model_name, topo.tp, topo.dp, cfg.model.max_model_len, cfg.cache.block_size,
                  cfg.model.dtype, cfg.cache.kv_cache_dtype)


def layout_mismatch(own: Layout, theirs: Layout | None) -> str | None:
    """Why a member's layout (from its Hello) cannot join ours, naming each differing value; None if it fits
    (a member that sends none, e.g. a trainer or a monitor, is not checked)."""
    if theirs is None:
        return None
    diffs = [f"{key} {getattr(theirs, key)!r} (coordinator: {getattr(own, key)!r})" for key in own.__struct_fields__
             if getattr(theirs, key) != getattr(own, key)]
    return "; ".join(diffs) or None


def check_devices(topo: Topology, platform_name: str, device_count: int) -> str | None:
    """More workers on this host (local engines x tp) than the accelerator devices present: why, naming the
    values. On CPU every worker is a process on the host's cores, so any layout runs (each worker's
    threads: OMP_NUM_THREADS, or torch's default) and none is refused."""
    if platform_name == "cpu":
        return None
    need = topo.dp_local * topo.tp
    if need > device_count:
        return (f"--data-parallel-size {topo.dp} (local {topo.dp_local}) x --tensor-parallel-size {topo.tp} needs "
                f"{need} {platform_name} devices on this host; {device_count} are present (use "
                "--data-parallel-size-local to run fewer engines per host)")
    return None
