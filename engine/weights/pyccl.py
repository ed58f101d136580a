"""NCCL (CUDA) and HCCL (NPU) communicators through ctypes, wire-compatible with vLLM's PyNcclCommunicator
and vLLM-Ascend's PyHcclCommunicator, plus the pickle format their unique ids travel in.

vLLM's trainers do not use torch.distributed's NCCL/HCCL process groups for weight transfer: rank 0 calls
``ncclGetUniqueId`` (``HcclGetRootInfo``), publishes the id object with ``StatelessProcessGroup.broadcast_obj``
(a pickle of vLLM's ctypes struct: ``_ctypes._unpickle(<module>.ncclUniqueId, ({}, <128 raw bytes>))``),
every rank calls ``ncclCommInitRank`` (``HcclCommInitRootInfo``) with it and then runs a one-element float32
sum all-reduce as a warm-up. This module does the same, with the same library calls; the id pickle is read
through engine.weights.safe_pickle with exactly the two globals it names, both replaced by local stand-ins (no
vLLM import, no ctypes call from the pickle).

Untested in this repository (no GPU or NPU here); written against the libraries' C APIs as vLLM and
vLLM-Ascend bind them. Library paths: ``VLLM_NCCL_SO_PATH`` (else libnccl.so.2), ``HCCL_SO_PATH`` (else
libhccl.so), vLLM's and vLLM-Ascend's variables.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from engine.weights.safe_pickle import PLAIN_DATA, UnsafePickleError, restricted_loads


@dataclass(frozen=True, slots=True)
class IdFormat:
    """How one library's unique id is pickled by vLLM (module and class of its ctypes struct, byte size)."""

    library: str
    module: str
    qualname: str
    nbytes: int


NCCL_ID = IdFormat("nccl", "vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId", 128)
HCCL_ID = IdFormat("hccl", "vllm_ascend.distributed.device_communicators.pyhccl_wrapper", "hcclUniqueId", 4108)


class _IdType:
    """Stand-in for vLLM's ctypes id struct while unpickling: only identifies which format was named."""

    def __init__(self, fmt: IdFormat):
        self.fmt = fmt


def dumps_unique_id(fmt: IdFormat, raw: bytes) -> bytes:
    """The pickle vLLM's ``broadcast_obj`` writes for the id struct, byte for byte what a vLLM peer unpickles
    into its own class (protocol 3: GLOBAL, EMPTY_DICT, BINBYTES, TUPLE2, TUPLE2, REDUCE)."""
    if len(raw) != fmt.nbytes:
        raise ValueError(f"a {fmt.library} unique id has {fmt.nbytes} bytes, got {len(raw)}")
    return (b"\x80\x03c_ctypes\n_unpickle\nc" + fmt.module.encode() + b"\n" + fmt.qualname.encode() + b"\n}"
            + b"B" + struct.pack("<I", len(raw)) + raw + b"\x86\x86R.")


def loads_unique_id(fmt: IdFormat, data: bytes, what: str) -> bytes:
    """The raw id bytes from a vLLM peer's pickle; any other global is an UnsafePickleError naming it."""
    id_type = _IdType(fmt)

    def unpickle(typ: Any, state: Any) -> bytes:
        if typ is not id_type:
            raise UnsafePickleError(f"_ctypes._unpickle of {type(typ).__name__}", what)
        if (not isinstance(state, tuple) or len(state) != 2 or state[0] != {}
                or not isinstance(state[1], bytes) or len(state[1]) != fmt.nbytes):
            raise ValueError(f"{what}: not a {fmt.qualname} ({fmt.nbytes} bytes)")
        return state[1]

    subs = {("_ctypes", "_unpickle"): unpickle, (fmt.module, fmt.qualname): id_type}
    out = restricted_loads(data, {**dict.fromkeys(PLAIN_DATA), **subs}, what=what)
    if not isinstance(out, bytes) or len(out) != fmt.nbytes:
        raise ValueError(f"{what}: expected a pickled {fmt.qualname}, got {type(out).__name__}")
    return out


# --- the libraries ----------------------------------------------------------------------------------------

# ncclDataType_t / HcclDataType values (vLLM's ncclDataTypeEnum, vLLM-Ascend's hcclDataTypeEnum)
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
                torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_HCCL_DTYPES = {torch.int8: 0, torch.int32: 2, torch.float16: 3, torch.float32: 4, torch.int64: 5,
                torch.uint8: 7, torch.float64: 10, torch.bfloat16: 11}
_SUM = 0  # ncclSum / HcclReduceOp sum


class CclCommunicator:
    """One communicator of ``world_size`` ranks on ``device``; collectives run on the current stream."""

    def __init__(self, fmt: IdFormat, device: torch.device):
        self.fmt, self.device = fmt, device
        self.nccl = fmt.library == "nccl"
        path = (os.environ.get("VLLM_NCCL_SO_PATH") or "libnccl.so.2") if self.nccl \
            else (os.environ.get("HCCL_SO_PATH") or "libhccl.so")
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"cannot load the {fmt.library.upper()} library {path!r}: {e}") from None
        self._dtypes = _NCCL_DTYPES if self.nccl else _HCCL_DTYPES
        self.comm: ctypes.c_void_p | None = None
        p = "nccl" if self.nccl else "Hccl"
        self._get_id = getattr(self.lib, "ncclGetUniqueId" if self.nccl else "HcclGetRootInfo")
        self._init = getattr(self.lib, "ncclCommInitRank" if self.nccl else "HcclCommInitRootInfo")
        self._bcast = getattr(self.lib, f"{p}Broadcast")
        self._allreduce = getattr(self.lib, f"{p}AllReduce")
        self._destroy = getattr(self.lib, f"{p}CommDestroy")
        self._abort = getattr(self.lib, "ncclCommAbort", None) if self.nccl else None
        self._errstr = getattr(self.lib, f"{p}GetErrorString")
        self._errstr.restype = ctypes.c_char_p
        # the id is a struct passed by value to ncclCommInitRank (a bare array would decay to a pointer)
        self._id_t = type(f"{fmt.qualname}_t", (ctypes.Structure,),
                          {"_fields_": [("internal", ctypes.c_byte * fmt.nbytes)]})

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            msg = self._errstr(result)
            raise RuntimeError(f"{call} failed: {msg.decode(errors='replace') if msg else result}")

    def unique_id(self) -> bytes:
        """A fresh id (rank 0's part of the handshake)."""
        buf = self._id_t()
        with _on(self.device):
            self._check(self._get_id(ctypes.byref(buf)), "get unique id")
        return bytes(bytearray(buf))

    def init_rank(self, world_size: int, unique_id: bytes, rank: int) -> None:
        """Join the communicator, then the warm-up all-reduce vLLM's communicators run right after init."""
        buf = self._id_t.from_buffer_copy(unique_id)
        comm = ctypes.c_void_p()
        with _on(self.device):
            if self.nccl:  # ncclCommInitRank(comm*, nranks, ncclUniqueId (by value), rank)
                self._init.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, self._id_t, ctypes.c_int]
                self._check(self._init(ctypes.byref(comm), world_size, buf, rank), "ncclCommInitRank")
            else:  # HcclCommInitRootInfo(nranks, const HcclRootInfo*, rank, comm*)
                self._check(self._init(world_size, ctypes.byref(buf), rank, ctypes.byref(comm)),
                            "HcclCommInitRootInfo")
            self.comm = comm
            self.all_reduce(torch.zeros(1, device=self.device))
            _stream(self.device, raw=False).synchronize()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        ptr, count, dt = ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), self._dtype(t)
        stream = ctypes.c_void_p(_stream(self.device))
        if self.nccl:  # ncclBroadcast(send, recv, count, dtype, root, comm, stream)
            self._check(self._bcast(ptr, ptr, count, dt, src, self.comm, stream), "ncclBroadcast")
        else:  # HcclBroadcast(buf, count, dtype, root, comm, stream)
            self._check(self._bcast(ptr, count, dt, src, self.comm, stream), "HcclBroadcast")

    def all_reduce(self, t: torch.Tensor) -> None:
        ptr = ctypes.c_void_p(t.data_ptr())
        self._check(self._allreduce(ptr, ptr, ctypes.c_size_t(t.numel()), self._dtype(t), _SUM, self.comm,
                                    ctypes.c_void_p(_stream(self.device))), "all_reduce")

    def destroy(self, abort: bool = False) -> None:
        comm, self.comm = self.comm, None
        if comm is None:
            return
        fn = self._abort if abort and self._abort is not None else self._destroy
        fn(comm)

    def _dtype(self, t: torch.Tensor) -> int:
        if t.device != self.device:
            raise ValueError(f"the {self.fmt.library} communicator works on {self.device}, got a tensor on {t.device}")
        try:
            return self._dtypes[t.dtype]
        except KeyError:
            raise ValueError(f"{self.fmt.library} cannot broadcast {t.dtype}") from None


def _on(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    return torch.npu.device(device)  # type: ignore[attr-defined]


def _stream(device: torch.device, raw: bool = True) -> Any:
    if device.type == "cuda":
        s = torch.cuda.current_stream(device)
        return s.cuda_stream if raw else s
    s = torch.npu.current_stream(device)  # type: ignore[attr-defined]
    return s.npu_stream if raw else s
