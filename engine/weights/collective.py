"""The weight-broadcast group between a trainer (rank 0) and the engine's workers, wire-compatible with
vLLM's trainer side: ``StatelessProcessGroup`` for the rendezvous, then vLLM's communicator handshake.

Rendezvous (vLLM's ``StatelessProcessGroup.create``, vllm/distributed/utils.py):
  rank 0 hosts a TCPStore on ``master_address:master_port`` created with ``world_size`` and
  ``wait_for_workers``: its constructor returns once every rank has connected. Every other rank connects
  as a client with the same ``world_size`` (the client's constructor counts it in). No other key is needed.
Objects (``broadcast_obj``): the source sets key ``broadcast_from/<src>/<n>`` (n counts that source's
  broadcasts from 0) to a pickle of the object; the others wait for the key and read it. Pickles are read
  only through engine.weights.safe_pickle with an allow-list of what the protocol carries.
Communicator (by platform, ``current_platform().dist_backend``):
  nccl (CUDA), hccl (NPU): as vLLM's PyNcclCommunicator / vLLM-Ascend's PyHcclCommunicator: rank 0's
    unique id is ``broadcast_from/0/0`` (vLLM's pickled ctypes struct), every rank inits the communicator
    with it, then a one-element float32 sum all-reduce (warm-up). See engine/weights/pyccl.py.
  gloo (CPU; vLLM has no CPU data plane, so this one is rollbus's, built the same way): rank 0 publishes
    a fresh store prefix (a str) as ``broadcast_from/0/0``; every rank builds ProcessGroupGloo on
    ``PrefixStore(<that prefix>, store)`` (what vLLM's ``init_gloo_process_group`` does given that prefix
    store), then the same warm-up all-reduce. A vLLM trainer joins it with vLLM's own
    StatelessProcessGroup + init_gloo_process_group (docs/weight-sync.md; tests/test_vllm_interop.py).
Broadcasts then follow vLLM's weight-transfer engines: one per tensor in its own dtype, or (packed) one
uint8 buffer per chunk.

Additions that vLLM peers never read: rollbus ranks above 0 claim ``rollbus/rank/<rank>`` (a second claim
is an error: two engines with the same rank_offset, or stale keys of an earlier group) and a rollbus rank 0
sets ``rollbus/formed`` once the group is complete (a late joiner is told so instead of hanging).

Failures are errors naming the address, port, rank and world size: TimeoutError (a rendezvous not
complete within ``timeout_s``), StoreCollision, ValueError (bad arguments), OSError (rank 0 cannot bind the
port, address not resolvable), ConnectionError (the store went away), UnsafePickleError (a store object
naming a global outside the allow-list).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
import uuid
from typing import Any

import torch
import torch.distributed as dist

from ascend_ops.platform import current_platform
from engine.weights.safe_pickle import PLAIN_DATA, restricted_loads

DEFAULT_OP_TIMEOUT_S = 600.0
GLOO_PREFIX = "rollbus/gloo/"  # + a fresh hex id per group
_POLL_S = 0.05


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class StoreCollision(ValueError):
    """The store already holds this rank, or a complete group: a second engine or trainer, or stale keys."""


class StatelessGroup:
    """vLLM's StatelessProcessGroup protocol: a TCPStore and the broadcast_obj key sequence."""

    def __init__(self, store: Any, rank: int, world_size: int, address: str, port: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.address, self.port = address, port
        self._sent = 0
        self._received = dict.fromkeys(range(world_size), 0)

    @property
    def what(self) -> str:
        return f"rank {self.rank} of world size {self.world_size} at {self.address}:{self.port}"

    @classmethod
    def create(cls, address: str, port: int, rank: int, world_size: int, timeout_s: float) -> StatelessGroup:
        what = f"rank {rank} of world size {world_size} at {address}:{port}"
        deadline = time.monotonic() + timeout_s
        try:
            socket.getaddrinfo(address, port)
        except socket.gaierror as e:
            raise OSError(f"cannot resolve master_address {address!r} ({what}): {e}") from None
        if rank == 0:
            try:
                store = dist.TCPStore(address, port, world_size, True, timeout=_td(timeout_s), use_libuv=False)
            except dist.DistStoreError as e:  # torch: "... waiting for clients. 1/3 clients joined."
                raise TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({what}): "
                                   f"not every rank connected to the store ({_joined(e)})") from None
            except dist.DistError as e:
                raise OSError(f"cannot host the weight-transfer store ({what}): {e}") from None
        else:
            store = _connect(address, port, world_size, deadline, timeout_s, what)
        return cls(store, rank, world_size, address, port)

    def broadcast_obj(self, obj: Any, src: int, *, data: bytes | None = None, timeout_s: float = 300.0,
                      loads: Any = None) -> Any:
        """vLLM's broadcast_obj. The source writes ``data`` (default: a pickle of ``obj``); the others return
        ``loads(bytes, what)`` (default: restricted_loads with plain data only)."""
        if self.rank == src:
            key = f"broadcast_from/{src}/{self._sent}"
            self.store.set(key, data if data is not None else pickle.dumps(obj))
            self._sent += 1
            return obj
        key = f"broadcast_from/{src}/{self._received[src]}"
        try:
            self.store.wait([key], _td(timeout_s))
        except dist.DistStoreError:
            raise TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({self.what}): rank "
                               f"{src} never published {key!r}") from None
        raw = self.store.get(key)
        self._received[src] += 1
        what = f"weight-transfer store {self.address}:{self.port} key {key!r}"
        return loads(raw, what) if loads is not None else restricted_loads(raw, PLAIN_DATA, what=what)

    def close(self) -> None:
        self.store = None


def _joined(e: BaseException) -> str:
    msg = str(e)
    i = msg.find("clients joined")
    return msg[max(0, msg.rfind(".", 0, i - 8) + 1):i + len("clients joined")].strip() if i >= 0 else msg


def _connect(address: str, port: int, world_size: int, deadline: float, timeout_s: float, what: str) -> Any:
    """Connect to rank 0's store within the deadline. TCPStore's own client retries with back-off and
    overshoots its timeout, so poll the port with a plain socket and build the client once it answers."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({what}): no store "
                               "answered (is the trainer, rank 0, up?)")
        try:
            socket.create_connection((address, port), timeout=min(left, 1.0)).close()
        except OSError:
            time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0)))
            continue
        try:
            # world_size + wait_for_workers: the constructor counts this client in, as vLLM's does; rank 0's
            # constructor waits for that count.
            return dist.TCPStore(address, port, world_size, False, timeout=_td(max(left, 1.0)), use_libuv=False)
        except dist.DistError:
            time.sleep(_POLL_S)  # the store went away between the probe and the connect


class PendingBroadcast:
    """An in-flight broadcast. ``wait()`` blocks until it completes (on CUDA/NPU the broadcast is ordered on
    the current stream when issued, torch's usual semantics) and drops the reference to the backend's work."""

    __slots__ = ("_work", "_group")

    def __init__(self, work: Any, group: WeightGroup) -> None:
        self._work, self._group = work, group

    def wait(self) -> None:
        work, self._work = self._work, None
        self._group._pending.discard(self)
        if work is not None:
            work.wait()


class WeightGroup:
    """One weight-broadcast group. Build it with :meth:`create`; every rank calls the same collectives in the
    same order. Tensors live on ``device`` (CPU for Gloo) and must be contiguous."""

    def __init__(self, *, comm: Any, group: StatelessGroup | None, rank: int, world_size: int,
                 device: torch.device, backend: str, address: str, port: int) -> None:
        self._comm, self._group = comm, group
        self.rank, self.world_size, self.device, self.backend = rank, world_size, device, backend
        self.master_address, self.master_port = address, port
        self._pending: set[PendingBroadcast] = set()

    @classmethod
    def create(cls, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
               device: torch.device | str | None = None, *, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
               ) -> WeightGroup:
        """Rendezvous and build the group; blocks until every rank has joined or ``timeout_s`` has passed.

        ``op_timeout_s`` bounds each later Gloo collective (a broadcast waits for its peers that long; NCCL and
        HCCL have no such bound). Raises TimeoutError, StoreCollision, ValueError, OSError, ConnectionError
        or UnsafePickleError (see the module docstring).
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
        backend = plat.dist_backend
        if backend not in ("gloo", "nccl", "hccl"):
            raise ValueError(f"no weight-transfer group for the {backend!r} backend (gloo, nccl, hccl)")
        deadline = time.monotonic() + timeout_s
        try:
            group = StatelessGroup.create(master_address, master_port, rank, world_size, timeout_s)
            try:
                comm = _handshake(group, backend, dev, deadline, timeout_s, op_timeout_s)
            except BaseException:
                group.close()
                raise
        except BaseException as e:
            # The traceback (kept by whoever catches this) must not keep rank 0's store, and so its port, alive.
            _clear_frames(e)
            raise
        return cls(comm=comm, group=group, rank=rank, world_size=world_size, device=dev, backend=backend,
                   address=master_address, port=master_port)

    @classmethod
    def from_unique_id(cls, unique_id: bytes, rank: int, world_size: int, device: torch.device | str | None = None,
                       ) -> WeightGroup:
        """vLLM's torch-free rendezvous (``nccl_unique_id_b64``): join an NCCL communicator whose id the trainer
        minted, without a store; every rank must enter concurrently. CUDA only."""
        from engine.weights.pyccl import NCCL_ID, CclCommunicator

        plat = current_platform()
        if plat.dist_backend != "nccl":
            raise ValueError(f"nccl_unique_id_b64 is an NCCL unique id: it needs the CUDA platform, this is "
                             f"{plat.name} ({plat.dist_backend}); use master_address/master_port")
        dev = torch.device(device) if device is not None else plat.device()
        comm = CclCommunicator(NCCL_ID, dev)
        comm.init_rank(world_size, unique_id, rank)
        return cls(comm=_Ccl(comm), group=None, rank=rank, world_size=world_size, device=dev, backend="nccl",
                   address="(unique id)", port=0)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``t`` in place from rank ``src``: its bytes on ``src`` end up in ``t`` on every rank."""
        self.broadcast_async(t, src).wait()

    def broadcast_async(self, t: torch.Tensor, src: int = 0) -> PendingBroadcast:
        """Start a broadcast and return at once; call ``.wait()`` before reading (or, on ``src``, reusing)
        ``t``. Several may be in flight; every rank must issue them in the same order."""
        comm = self._live()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} is outside world size {self.world_size}")
        if t.device.type != self.device.type:
            raise ValueError(f"the {self.backend} weight group broadcasts {self.device.type} tensors, got {t.device}")
        if not t.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        pending = PendingBroadcast(comm.broadcast(t, src), self)
        self._pending.add(pending)
        return pending

    def barrier(self) -> None:
        """Block until every rank reached the barrier (a one-element all-reduce on the group's device)."""
        self._live().all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device))
        current_platform().synchronize()

    def destroy(self, abort: bool = False) -> None:
        """Release the communicator and the store (on rank 0, the listening port). Idempotent. Broadcasts still
        in flight are abandoned: wait for them first (or ``abort=True`` when a peer is gone)."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        for p in list(self._pending):
            p._work = None
        self._pending.clear()
        comm.destroy(abort)
        del comm
        if self._group is not None:
            self._group.close()
            self._group = None

    @property
    def destroyed(self) -> bool:
        return self._comm is None

    def _live(self) -> Any:
        if self._comm is None:
            raise RuntimeError("the weight group was destroyed")
        return self._comm


# --- the communicator handshake ------------------------------------------------------------------------


def _handshake(group: StatelessGroup, backend: str, dev: torch.device, deadline: float, timeout_s: float,
               op_timeout_s: float) -> Any:
    rank, what = group.rank, group.what
    store = group.store
    try:
        if rank > 0:
            if store.add(f"rollbus/rank/{rank}", 1) > 1:
                raise StoreCollision(f"rank {rank} is already taken in the weight-transfer group ({what}): a "
                                     "second engine joined this trainer with the same rank_offset, or the store "
                                     "holds keys of an earlier group")
            if store.check(["rollbus/formed"]):
                raise StoreCollision(f"the weight-transfer group at {group.address}:{group.port} is already "
                                     f"complete ({what}): a second engine, or a stale trainer store on this port")
        left = max(deadline - time.monotonic(), 0.001)
        if backend == "gloo":
            comm: Any = _Gloo(group, dev, left, timeout_s, op_timeout_s)
        else:
            comm = _Ccl.handshake(group, backend, dev, left, timeout_s)
        if rank == 0:
            store.set("rollbus/formed", "1")
        return comm
    except dist.DistStoreError as e:
        raise TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({what}): {e}") from None
    except RuntimeError as e:  # DistError and the backends' own connect errors
        if time.monotonic() >= deadline:
            raise TimeoutError(f"weight-transfer rendezvous timed out after {timeout_s:g} s ({what}): {e}") from None
        raise ConnectionError(f"weight-transfer rendezvous failed ({what}): {e}") from None


def _check_prefix(obj: Any, what: str) -> str:
    if not isinstance(obj, str) or not obj or len(obj) > 256:
        raise ValueError(f"{what}: the CPU (Gloo) weight-transfer group expects a store prefix (str) from rank 0, "
                         f"got {type(obj).__name__}")
    return obj


class _Gloo:
    """The CPU data plane: ProcessGroupGloo on PrefixStore(<rank 0's prefix>, store), then the warm-up."""

    def __init__(self, group: StatelessGroup, dev: torch.device, connect_s: float, timeout_s: float,
                 op_timeout_s: float):
        if group.rank == 0:
            prefix = group.broadcast_obj(f"{GLOO_PREFIX}{uuid.uuid4().hex}/", 0)
        else:
            prefix = group.broadcast_obj(None, 0, timeout_s=connect_s,
                                         loads=lambda raw, what: _check_prefix(
                                             restricted_loads(raw, PLAIN_DATA, what=what), what))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(connect_s)  # bounds the full-mesh connect inside the constructor
        opts._devices = [_gloo_device(group.address)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, group.store), group.rank, group.world_size, opts)
        self.pg.set_timeout(_td(connect_s))
        self.all_reduce(torch.zeros(1, dtype=torch.float32))  # warm-up, as vLLM's communicators do
        self.pg.set_timeout(_td(op_timeout_s))  # later collectives

    def broadcast(self, t: torch.Tensor, src: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([t], opts)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def destroy(self, abort: bool = False) -> None:
        pg, self.pg = self.pg, None
        try:
            (pg.abort if abort else pg.shutdown)()
        except (RuntimeError, AttributeError):
            pass  # dropping the last reference destroys it


class _Ccl:
    """NCCL / HCCL through engine.weights.pyccl, the unique id exchanged as vLLM's PyNccl/PyHccl communicators do."""

    def __init__(self, comm: Any):
        self.comm = comm

    @classmethod
    def handshake(cls, group: StatelessGroup, backend: str, dev: torch.device, connect_s: float,
                  timeout_s: float) -> _Ccl:
        from engine.weights.pyccl import HCCL_ID, NCCL_ID, CclCommunicator, dumps_unique_id, loads_unique_id

        fmt = NCCL_ID if backend == "nccl" else HCCL_ID
        comm = CclCommunicator(fmt, dev)
        if group.rank == 0:
            uid = comm.unique_id()
            group.broadcast_obj(uid, 0, data=dumps_unique_id(fmt, uid))
        else:
            uid = group.broadcast_obj(None, 0, timeout_s=connect_s,
                                      loads=lambda raw, what: loads_unique_id(fmt, raw, what))
        comm.init_rank(group.world_size, uid, group.rank)
        return cls(comm)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.comm.broadcast(t, src)  # stream-ordered: nothing to wait for

    def all_reduce(self, t: torch.Tensor) -> None:
        self.comm.all_reduce(t)

    def destroy(self, abort: bool = False) -> None:
        self.comm.destroy(abort)


def _clear_frames(e: BaseException) -> None:
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


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
