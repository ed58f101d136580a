"""What each engine holds, as its KV events (--kv-events-config) say, for bench/fleet_routing.py: a second
subscriber beside the router's on every engine's PUB endpoint, which rebuilds each engine's prefix cache
from BlockStored / BlockRemoved / AllBlocksCleared and answers, for a prompt about to be sent, how many of
its tokens each engine could reuse (whole blocks, never the last token). Comparing that with the engine the
router picked and what it reused separates a routing choice from a late or wrong event."""

from __future__ import annotations

import threading

import zmq

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


class KVEventView:
    def __init__(self, endpoints: dict[str, str], block_size: int):
        """endpoints: an engine's URL -> its event endpoint (connectable)."""
        self.block_size = block_size
        self._lock = threading.Lock()
        self._prefix: dict[str, dict[int, tuple[int, ...]]] = {url: {} for url in endpoints}  # hash -> tokens
        self._held: dict[str, set[tuple[int, ...]]] = {url: set() for url in endpoints}  # token prefixes
        self.unanchored = 0  # BlockStored whose parent this view never saw
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, ep), daemon=True, name=f"kv-view-{url}")
                         for url, ep in endpoints.items()]
        self._ready = threading.Barrier(len(endpoints) + 1)
        for t in self._threads:
            t.start()
        self._ready.wait(10)

    def reusable(self, url: str, ids: list[int]) -> int:
        """Tokens of `ids` the engine at url holds, by its events so far."""
        bs, k = self.block_size, 0
        with self._lock:
            held = self._held[url]
            while (k + 1) * bs <= len(ids) - 1 and tuple(ids[:(k + 1) * bs]) in held:
                k += 1
        return k * bs

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)

    def _run(self, url: str, endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._ready.wait(10)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                _topic, _seq, payload = sock.recv_multipart()
                with self._lock:
                    for event in decode_batch(payload).events:
                        self._apply(url, event)
        finally:
            sock.close(0)

    def _apply(self, url: str, event: object) -> None:
        prefix, held, bs = self._prefix[url], self._held[url], self.block_size
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if parent is not None and parent not in prefix:
                self.unanchored += 1
                return
            tokens = prefix[parent] if parent is not None else ()
            for i, h in enumerate(event.block_hashes):
                tokens = tokens + tuple(event.token_ids[i * bs:(i + 1) * bs])
                prefix[h] = tokens
                held.add(tokens)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                held.discard(prefix.pop(h, ()))
        elif isinstance(event, AllBlocksCleared):
            prefix.clear()
            held.clear()
