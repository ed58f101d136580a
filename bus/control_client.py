"""A blocking client for the acknowledged control broadcast: send a command through the coordinator,
get the reply once every member acked. For scripts, benchmarks and trainers that talk to the bus
directly (the gateway uses its asyncio twin in gateway/engine_client.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from bus.codec import CodecError, decode
from bus.endpoints import Endpoints
from bus.messages import CommandBody, ControlReply, ControlRequest, command_name
from bus.sockets import make_socket, send


class ControlClient:
    def __init__(self, ep: Endpoints, name: str | None = None):
        self.ctx = zmq.Context()
        ep.secure(self.ctx)
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=ep.control,
                                identity=name or f"client-{uuid.uuid4().hex[:8]}")

    def request(self, command: CommandBody, timeout_s: float = 10.0) -> ControlReply:
        """Broadcast a typed command (bus.messages), e.g. `request(Health())`. Raises TimeoutError when
        the coordinator does not answer within timeout_s + 5 s."""
        rid = uuid.uuid4().hex
        return self.call(ControlRequest(rid, command, timeout_s), ControlReply, timeout_s + 5)

    def call(self, msg: Any, reply_type: type, timeout_s: float) -> Any:
        """Send a message carrying a request_id; wait for the reply of reply_type with the same id."""
        send(self.sock, msg)
        body = getattr(msg, "body", None)
        return self.wait(msg.request_id, reply_type, timeout_s,
                         command_name(body) if body is not None else type(msg).__name__)

    def wait(self, request_id: str, reply_type: type, timeout_s: float, what: str = "request") -> Any:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(left * 1000):
                try:
                    reply = decode(self.sock.recv_multipart())
                except CodecError:
                    continue
                if isinstance(reply, reply_type) and reply.request_id == request_id:
                    return reply
        raise TimeoutError(f"no reply to {what!r} from the coordinator")

    def close(self) -> None:
        self.ctx.destroy(linger=0)
