"""Publishes the block manager's KV events (engine.kv_events) on a ZeroMQ PUB socket, as vLLM's
ZmqEventPublisher does: one message `[topic, seq (8 bytes big-endian), msgpack(EventBatch)]` per scheduler
loop turn that changed the prefix cache, seq counting from 0; with a replay endpoint, a ROUTER socket
answers `[identity, b"", start_seq (8 bytes)]` with every buffered batch from that seq on
(`[identity, b"", seq, payload]` each) and then `[identity, b"", -1 (8 bytes, signed), b""]`.

A thread owns both sockets and does the encoding, so the scheduler's loop only appends a list to a queue.
The sockets are plain ZeroMQ (vLLM's consumers speak no CURVE): the endpoint decides who can connect.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

import structlog
import zmq

from engine.kv_events import KVCacheEvent, KVEventsConfig, binds, encode_batch

log = structlog.get_logger()

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, ctx: zmq.Context, data_parallel_rank: int = 0):
        self.endpoint, self.replay_endpoint = cfg.endpoints_for(data_parallel_rank)
        self.rank = data_parallel_rank
        self.topic = cfg.topic.encode()
        self.queue: queue.Queue[list[KVCacheEvent] | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.dropped = 0
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.set_hwm(cfg.hwm)
        if binds(self.endpoint):  # errors (a port in use) surface here, at start-up
            self.pub.bind(self.endpoint)
        else:
            self.pub.connect(self.endpoint)
        self.replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(self.replay_endpoint)
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        log.info("scheduler.kv_events", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 topic=cfg.topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """From the scheduler's loop: never blocks; a full queue drops the batch (counted, logged once)."""
        try:
            self.queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("scheduler.kv_events_dropped", why="the publisher's queue is full (max_queue_size)")

    def close(self, timeout_s: float = 1.0) -> None:
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self.thread.join(timeout_s)

    def _run(self) -> None:
        seq = 0
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        try:
            while True:
                if self.replay is not None and poller.poll(0):
                    self._serve_replay()
                try:
                    events = self.queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if events is None:
                    break
                payload = encode_batch(events, self.rank)
                seq_bytes = seq.to_bytes(8, "big")
                self.pub.send_multipart((self.topic, seq_bytes, payload))
                self.buffer.append((seq, payload))
                seq += 1
        except zmq.ContextTerminated:
            pass
        finally:
            self.pub.close(0)
            if self.replay is not None:
                self.replay.close(0)

    def _serve_replay(self) -> None:
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("scheduler.kv_events_bad_replay_request", frames=len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))
