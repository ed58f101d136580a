"""Small helpers so every actor makes sockets the same way: one context per process, linger bounded,
messages encoded with bus.codec, tcp sockets under the context's CURVE keys (bus.auth), ipc sockets
owner-only. The actors' poll loops own the sockets (zguide: a socket stays in the thread that made it)."""

from __future__ import annotations

import os
from typing import Any

import zmq

from bus import frame_limits
from bus.auth import secure_socket
from bus.codec import decode, encode
from bus.messages import GatewayReady, Ready, SchedulerReady, WorkerInfo


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                identity: str | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if (bind or connect or "").startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)  # an IPv6 --bus-host (written tcp://[addr]:port)
    if kind == zmq.XPUB:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every (re)subscription, not only the first
    if bind:
        if bind.startswith("tcp://"):
            secure_socket(ctx, sock, server=True)
        frame_limits.apply(ctx, sock, bind)  # the largest frame a peer may send it (Endpoints.secure)
        sock.bind(bind)
        if bind.startswith("ipc://"):
            os.chmod(bind[len("ipc://"):], 0o600)  # the folder is 0700 too; the socket itself owner-only
    if connect:
        if connect.startswith("tcp://"):
            secure_socket(ctx, sock, server=False)
        sock.connect(connect)
    return sock


def send(sock: zmq.Socket, msg: Any, *, topic: bytes | None = None, to: bytes | None = None) -> None:
    frames = encode(msg)
    if topic is not None:
        frames.insert(0, topic)
    if to is not None:
        frames.insert(0, to)
    sock.send_multipart(frames, copy=False)


def recv_from(sock: zmq.Socket) -> tuple[bytes, Any]:
    """ROUTER receive: (sender identity, message)."""
    frames = sock.recv_multipart()
    return frames[0], decode(frames[1:])


def recv(sock: zmq.Socket, *, topic: bool = False) -> Any:
    frames = sock.recv_multipart()
    return decode(frames[1:] if topic else frames)


def subscription_event(frame: bytes) -> tuple[bool, bytes]:
    """XPUB receive: (subscribed?, topic). Anything but a (un)subscription (a peer's XSUB can send any
    bytes upstream) is (False, b""), which names no member: it must never read as a member leaving."""
    if frame[:1] not in (b"\x00", b"\x01"):
        return False, b""
    return frame[:1] == b"\x01", frame[1:]


def member_name(topic: bytes) -> str | None:
    """The member a presence topic (b"@" + name) names, or None."""
    if not topic.startswith(b"@"):
        return None
    try:
        return topic[1:].decode()
    except UnicodeDecodeError:
        return None


def report_ready(ctx: zmq.Context, ready_endpoint: str | None, role: str, name: str,
                 info: WorkerInfo | SchedulerReady | GatewayReady | None = None) -> None:
    """Tell the launcher (if any) that this process finished start-up."""
    if not ready_endpoint:
        return
    sock = make_socket(ctx, zmq.PUSH, connect=ready_endpoint)
    send(sock, Ready(role, name, os.getpid(), info))
    sock.close(linger=2000)  # linger so the message leaves before the socket goes
