"""The recovery copies' file format, read without torch: a safetensors file (8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes) whose header's
`__metadata__` tags it with the run, the number of updates committed and the version's label
(engine.weights.recovery.save_copy). The coordinator reads the tags at a restart (engine.fleet.rejoin), a
gateway checks them before it sends a copy to a peer (gateway/weight_copy_route.py), and a restarted peer
checks, and retags, what it received (engine.fleet.catch_up). Pure: file objects in, dicts and bytes out.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, BinaryIO

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
TAG_KEYS = ("run_id", "weight_commits", "weight_version")


def copy_name(index: int) -> str:
    """Worker `index`'s copy in the folder (engine.weights.recovery.copy_path)."""
    return f"worker-{index}.safetensors"


def read_exact(f: BinaryIO, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            raise ValueError(f"ends after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def read_header(f: BinaryIO) -> tuple[dict[str, Any], bytes]:
    """The parsed header and the raw bytes it was read from (its length prefix included); ValueError when
    `f` does not start with a safetensors header."""
    prefix = read_exact(f, 8)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {n} bytes (more than safetensors allows)")
    raw = read_exact(f, n)
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, prefix + raw


def tag_of(header: dict[str, Any]) -> dict[str, str] | None:
    """The copy's tag ({run_id, weight_commits, weight_version}), or None when the header has none."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in TAG_KEYS):
        return None
    if not meta["weight_commits"].isdigit() or not meta["run_id"]:
        return None
    return meta


def layout_of(header: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape (what must agree between two copies of one worker's weights)."""
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or not isinstance(t.get("shape"), list):
            raise ValueError(f"tensor {name!r} has no dtype and shape")
        out[name] = (t["dtype"], tuple(t["shape"]))
    return out


def data_length(header: dict[str, Any]) -> int:
    """The bytes after the header: the end of the last tensor's byte range."""
    ends = [t["data_offsets"][1] for n, t in header.items() if n != "__metadata__"]
    if not all(isinstance(e, int) and e >= 0 for e in ends):
        raise ValueError("a tensor without a valid byte range")
    return max(ends, default=0)


def encode_header(header: dict[str, Any]) -> bytes:
    """The length prefix and the header, padded with spaces to 8 bytes as safetensors writes it."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def retagged(header: dict[str, Any], **tag: str) -> bytes:
    """The header with its tag replaced (other metadata kept), encoded."""
    meta = {**(header.get("__metadata__") or {}), **tag}
    return encode_header({**header, "__metadata__": meta})


class TensorHashes:
    """sha256 of each tensor's bytes (/weight_checker's checksum of it), fed the data section chunk by chunk,
    and the copy's digest: sha256 of the header's raw bytes followed by every tensor's sha256 in file order,
    which covers every byte of the copy in one pass. ValueError when the tensors do not tile the data
    section (a gap or an overlap: bytes no checksum would cover)."""

    def __init__(self, header: dict[str, Any], raw_header: bytes) -> None:
        self.raw_header = raw_header
        self.ranges = sorted((t["data_offsets"][0], t["data_offsets"][1], n) for n, t in header.items()
                             if n != "__metadata__")
        end = 0
        for start, stop, name in self.ranges:
            if start != end or stop < start:
                raise ValueError(f"tensor {name!r} does not start where the one before it ends")
            end = stop
        self.hashes = {n: hashlib.sha256() for _, _, n in self.ranges}
        self.pos, self.i = 0, 0

    def update(self, chunk: bytes) -> None:
        view, at = memoryview(chunk), 0
        while at < len(view) and self.i < len(self.ranges):
            _, end, name = self.ranges[self.i]
            step = min(end - self.pos, len(view) - at)
            self.hashes[name].update(view[at:at + step])
            at += step
            self.pos += step
            if self.pos >= end:
                self.i += 1

    def tensors(self) -> dict[str, str]:
        return {n: h.hexdigest() for n, h in self.hashes.items()}

    def digest(self) -> str:
        h = hashlib.sha256(self.raw_header)
        for _, _, name in self.ranges:
            h.update(self.hashes[name].digest())
        return h.hexdigest()


def copy_digest(f: BinaryIO, chunk_bytes: int = 4 << 20) -> str:
    """The digest (TensorHashes.digest) of the copy `f` reads, from where it stands."""
    header, raw = read_header(f)
    hashes = TensorHashes(header, raw)
    while chunk := f.read(chunk_bytes):
        hashes.update(chunk)
    return hashes.digest()
