"""A stateless process group for broadcasting weights from a trainer (rank 0) into the engine's workers.

The group never touches torch.distributed's global state: no ``init_process_group``, no default group, no
group registry. Rank 0 hosts a TCPStore on ``master_address:master_port``, the other ranks connect to it,
and the backend process group (Gloo on CPU, NCCL on CUDA, HCCL via torch_npu on NPU; picked by
``current_platform().dist_backend``) is constructed directly on a prefix of that store. So a trainer that
already runs under torchrun, with its own default group, can create one too (rank 0 here is rank 0 of this
group only; cf. sglang #19251), and ``destroy()`` frees the port for a later group.

Rendezvous (create): rank 0 starts the store; every other rank polls the port until it answers, then joins.
Every rank registers under ``join/<rank>`` and waits for all of them; a rank registered twice, a different
world size, or a rendezvous not complete within ``timeout_s`` is an error naming the address, port, rank and
world size (TimeoutError for the deadline). Only then is the backend built, so a dead peer fails the
rendezvous instead of hanging inside a collective.

Only the Gloo path runs in this repository's tests; NCCL and HCCL follow torch's and torch_npu's own
group-construction code.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ascend_ops.platform import current_platform

STORE_PREFIX = "rollbus-weight-group/"
DEFAULT_OP_TIMEOUT_S = 600.0
_POLL_S = 0.05


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class PendingBroadcast:
    """An in-flight broadcast. ``wait()`` blocks until it completes (on CUDA/NPU: until it is ordered before
    later work on the current stream, torch's usual semantics) and then drops the reference to torch's work
    object, which would otherwise keep the process group, and rank 0's store port, alive."""

    __slots__ = ("_work", "_group")

    def __init__(self, work: Any, group: WeightGroup) -> None:
        self._work, self._group = work, group

    def wait(self) -> None:
        work = self._work
        if work is None:
            return
        try:
            work.wait()
        finally:
            self._work = None
            self._group._pending.discard(self)

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


class WeightGroup:
    """One weight-broadcast group. Build it with :meth:`create`; every rank calls the same collectives in the
    same order. Tensors live on ``device`` (CPU for Gloo) and must be contiguous."""

    def __init__(self, *, pg: Any, store: Any, tcp_store: Any, rank: int, world_size: int, device: torch.device,
                 backend: str, address: str, port: int) -> None:
        self._pg, self._store, self._tcp = pg, store, tcp_store
        self.rank, self.world_size, self.device, self.backend = rank, world_size, device, backend
        self.master_address, self.master_port = address, port
        self._pending: set[PendingBroadcast] = set()

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def create(cls, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
               device: torch.device | str | None = None, *,
               op_timeout_s: float = DEFAULT_OP_TIMEOUT_S) -> WeightGroup:
        """Rendezvous and build the group; blocks until every rank has joined or ``timeout_s`` has passed.

        ``op_timeout_s`` bounds each later collective (the backend's own timeout; a broadcast waits for its
        peers that long). Raises TimeoutError (deadline), ValueError (bad arguments, duplicate rank, world
        size mismatch), OSError (port not available on rank 0, master address not resolvable) or
        ConnectionError (the store went away during the rendezvous).
        """
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address must be a host name or address, got {master_address!r}")
        for what, v in (("master_port", master_port), ("rank", rank), ("world_size", world_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{what} must be an integer, got {v!r}")
        if not 0 < master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {master_port}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not timeout_s > 0 or not op_timeout_s > 0:
            raise ValueError(f"timeouts must be positive, got timeout_s={timeout_s} op_timeout_s={op_timeout_s}")
        plat = current_platform()
        dev = torch.device(device) if device is not None else plat.device()
        if dev.type != plat.device_type:
            raise ValueError(f"device {dev} does not match this platform ({plat.name}, backend {plat.dist_backend})")
        try:
            tcp, store, pg = _rendezvous(master_address, master_port, rank, world_size, timeout_s, op_timeout_s,
                                         dev, plat.dist_backend)
        except BaseException as e:
            # The traceback (kept by whoever catches this) must not keep rank 0's store, and so its port, alive.
            _clear_frames(e)
            raise
        return cls(pg=pg, store=store, tcp_store=tcp, rank=rank, world_size=world_size, device=dev,
                   backend=plat.dist_backend, address=master_address, port=master_port)

    # --- collectives ------------------------------------------------------------------------------

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``t`` in place from rank ``src``: its bytes on ``src`` end up in ``t`` on every rank."""
        self.broadcast_async(t, src).wait()

    def broadcast_async(self, t: torch.Tensor, src: int = 0) -> PendingBroadcast:
        """Start a broadcast and return at once; call ``.wait()`` before reading (or, on ``src``, reusing)
        ``t``. Several may be in flight; every rank must issue them in the same order."""
        pg = self._live()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} is outside world size {self.world_size}")
        if t.device.type != self.device.type:
            raise ValueError(f"the {self.backend} weight group broadcasts {self.device.type} tensors, got {t.device}")
        if not t.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        pending = PendingBroadcast(pg.broadcast([t], opts), self)
        self._pending.add(pending)
        return pending

    def barrier(self) -> None:
        """Block until every rank reached the barrier (a one-element all-reduce on the group's device)."""
        pg = self._live()
        t = torch.zeros(1, dtype=torch.int32, device=self.device)
        pg.allreduce([t]).wait()
        current_platform().synchronize()

    def destroy(self) -> None:
        """Release the backend and the store (on rank 0, the listening port). Idempotent. Broadcasts still in
        flight are abandoned: wait for them first."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        for p in list(self._pending):
            p._work = None
        self._pending.clear()
        if self.rank == 0:
            try:
                self._store.set("closed", "1")  # a late joiner that reached this store will not use it
            except dist.DistError:
                pass
        try:
            pg.shutdown()
        except (RuntimeError, AttributeError):
            pass  # not every backend implements shutdown; dropping the last reference destroys it
        del pg
        self._store = self._tcp = None

    @property
    def destroyed(self) -> bool:
        return self._pg is None

    def _live(self) -> Any:
        if self._pg is None:
            raise RuntimeError("the weight group was destroyed")
        return self._pg

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._pg is None else self.backend
        return (f"WeightGroup(rank={self.rank}, world_size={self.world_size}, "
                f"{self.master_address}:{self.master_port}, {state})")


def _rendezvous(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
                op_timeout_s: float, dev: torch.device, backend: str) -> tuple[Any, Any, Any]:
    what = f"rank {rank} of world size {world_size} at {master_address}:{master_port}"
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        return deadline - time.monotonic()

    def timed_out(detail: str) -> TimeoutError:
        return TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({what}): {detail}")

    try:
        socket.getaddrinfo(master_address, master_port)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve master_address {master_address!r} ({what}): {e}") from None

    if rank == 0:
        try:
            tcp = dist.TCPStore(master_address, master_port, None, True, timeout=_td(timeout_s),
                                wait_for_workers=False)
        except dist.DistError as e:
            raise OSError(f"cannot host the weight-transfer store ({what}): {e}") from None
    else:
        tcp = _connect(master_address, master_port, remaining, timed_out)
    store = dist.PrefixStore(STORE_PREFIX, tcp)
    try:
        if store.add(f"join/{rank}", 1) > 1:
            raise ValueError(f"rank {rank} joined the weight-transfer group twice ({what}): two processes "
                             "claim the same rank, or a stale group still runs on this port")
        if rank == 0:
            store.set("world_size", str(world_size))
        else:
            try:
                store.wait(["world_size"], _td(remaining()))
            except dist.DistStoreError:
                raise timed_out("rank 0 never announced the world size") from None
            theirs = int(store.get("world_size"))
            if theirs != world_size:
                raise ValueError(f"world size mismatch ({what}): rank 0 uses world size {theirs}")
        try:
            store.wait([f"join/{r}" for r in range(world_size)], _td(remaining()))
        except dist.DistStoreError:
            missing = [r for r in range(world_size) if not store.check([f"join/{r}"])]
            raise timed_out(f"ranks {missing} never joined") from None
        if remaining() <= 0:
            raise timed_out("every rank joined, but too late")
        pg = _make_backend(backend, store, rank, world_size, dev, master_address, master_port,
                           remaining(), op_timeout_s)
    except dist.DistStoreError as e:
        raise timed_out(str(e)) from None
    except RuntimeError as e:  # DistError and the backends' own connect errors
        if remaining() <= 0:
            raise timed_out(str(e)) from None
        raise ConnectionError(f"weight-transfer rendezvous failed ({what}): {e}") from None
    return tcp, store, pg


def _clear_frames(e: BaseException) -> None:
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


def _connect(address: str, port: int, remaining: Any, timed_out: Any) -> Any:
    """Connect to rank 0's store within the deadline.

    TCPStore's own client retries with back-off and overshoots its timeout by seconds, so poll the port
    with a plain socket and only build the client once it answers. A store that rank 0 is closing
    (``closed`` set by ``destroy``) is skipped: its successor will come up on the same port.
    """
    while True:
        left = remaining()
        if left <= 0:
            raise timed_out("no store answered (is the trainer, rank 0, up?)")
        try:
            socket.create_connection((address, port), timeout=min(left, 1.0)).close()
        except OSError:
            time.sleep(min(_POLL_S, max(remaining(), 0)))
            continue
        try:
            tcp = dist.TCPStore(address, port, None, False, timeout=_td(max(remaining(), 1.0)),
                                wait_for_workers=False)
            if not tcp.check([STORE_PREFIX + "closed"]):
                return tcp
        except dist.DistError:
            pass  # the store went away between the probe and the connect
        time.sleep(_POLL_S)


def _gloo_device(address: str) -> Any:
    """The Gloo device on the interface that reaches ``address`` (GLOO_SOCKET_IFNAME, if set, wins).

    torch's default resolves this host's name, which on many machines yields a loopback address that peers
    on other hosts cannot reach."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"].split(",")[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # no packet is sent; this only picks the route
            local = s.getsockname()[0]
        return dist.ProcessGroupGloo.create_device(hostname=local)
    except OSError:
        return dist.ProcessGroupGloo.create_default_device()


def _make_backend(backend: str, store: Any, rank: int, world_size: int, dev: torch.device, address: str,
                  port: int, connect_s: float, op_timeout_s: float) -> Any:
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(connect_s)  # bounds the full-mesh connect inside the constructor
        opts._devices = [_gloo_device(address)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, opts)
        pg.set_timeout(_td(op_timeout_s))  # later collectives
        return pg
    if backend == "nccl":
        # Untested here (no GPU). Mirrors torch's _new_process_group_helper / vLLM's stateless group.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(op_timeout_s)
        opts.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, opts)
    elif backend == "hccl":
        # Untested here (no NPU). Mirrors torch_npu's own HCCL group construction.
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

        opts = ProcessGroupHCCL.Options()
        opts._timeout = _td(op_timeout_s)
        opts.is_high_priority_stream = False
        if hasattr(opts, "group_id"):
            opts.group_id = f"rollbus_weights_{port}"  # the same on every rank of this group
        pg = ProcessGroupHCCL(dist.PrefixStore("hccl/", store), rank, world_size, opts)
    else:
        raise ValueError(f"no weight-transfer group for the {backend!r} backend (gloo, nccl, hccl)")
    pg._set_sequence_number_for_group()
    # NCCL/HCCL communicators are created lazily by the first collective: run one now, while every rank is
    # known to be present, so a failure shows up here rather than inside the first weight broadcast.
    t = torch.zeros(1, dtype=torch.int32, device=dev)
    pg.allreduce([t]).wait()
    current_platform().synchronize()
    return pg
