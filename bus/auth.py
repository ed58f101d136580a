"""Who may talk on a tcp bus: ZeroMQ CURVE (built into libzmq) on every tcp socket.

A key folder (`rollbus keys DIR`, pyzmq's certificate format, files 0600, folder 0700) holds

    server.key  server.key_secret   the engine's pair: every binding socket (scheduler, coordinator)
                                    is a CURVE server with it; clients pin server.key
    client.key  client.key_secret   the pair every connecting socket (members, trainers) presents

The binding processes run a ZAP handler (zmq.auth.ThreadAuthenticator) that accepts a client only if its
public key is in the allow-list: client.key plus any other `*.key` public key put in the folder (one per
extra trainer). A peer without the key, with another key, or speaking plain ZMTP never completes the
handshake: it sends nothing to the engine and receives nothing. ipc:// sockets are not affected (their
folder is 0700: filesystem permissions are their access control).

The keys are per zmq.Context: a process calls `attach(ctx, keys)` (via Endpoints.secure) once, and
bus.sockets.make_socket applies the server or the client side to every tcp socket made in that context.
tcp without keys needs --bus-insecure and a loopback --bus-host (bus.auth.check_config).
"""

from __future__ import annotations

import ipaddress
import os
import stat
import threading
import weakref
from dataclasses import dataclass, field

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = structlog.get_logger()

ENV_DIR = "ROLLBUS_BUS_CURVE_DIR"
ENV_INSECURE = "ROLLBUS_BUS_INSECURE"
ZAP_DOMAIN = b"rollbus"


class BusKeyError(ValueError):
    """A key folder or file that cannot be used; the message names the file."""


@dataclass(frozen=True, slots=True)
class BusKeys:
    server_public: bytes  # z85, 40 bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None  # only where the folder has server.key_secret
    allowed: frozenset[bytes] = field(default_factory=frozenset)  # client public keys the servers accept
    folder: str = ""


# ------------------------------------------------------------------------------------ key files


def generate(folder: str, *, force: bool = False) -> list[str]:
    """Write a server and a client key pair into folder (created 0700); every file 0600."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    names = [os.path.join(folder, n) for n in ("server.key", "server.key_secret", "client.key", "client.key_secret")]
    existing = [n for n in names if os.path.exists(n)]
    if existing and not force:
        raise BusKeyError(f"{existing[0]} exists: keep the keys, or pass --force to replace them")
    old = os.umask(0o177)
    try:
        for n in names:
            if os.path.exists(n):
                os.unlink(n)
        zmq.auth.create_certificates(folder, "server")
        zmq.auth.create_certificates(folder, "client")
    finally:
        os.umask(old)
    for n in names:
        os.chmod(n, 0o600)
    return names


def _read(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise BusKeyError(f"bus key file {path} does not exist (create the folder with `rollbus keys DIR`)")
    if secret:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise BusKeyError(f"bus key file {path} is readable by other users (mode {mode:04o}): chmod 600 it")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise BusKeyError(f"bus key file {path} is not a ZeroMQ certificate: {e}") from None
    for what, k in (("public", public), ("secret", sec)):
        if k is None:
            continue
        try:
            ok = len(k) == 40 and len(z85.decode(k)) == 32
        except (ValueError, KeyError, TypeError, IndexError):
            ok = False
        if not ok:
            raise BusKeyError(f"bus key file {path}: its {what} key is not a 40-character Z85 CURVE key")
    if secret and sec is None:
        raise BusKeyError(f"bus key file {path} has no secret-key")
    return public, sec


def load(folder: str, *, server: bool) -> BusKeys:
    """The keys in folder. server=True: the engine's processes (need server.key_secret too); False: a
    trainer or other client (server.key and client.key_secret are enough)."""
    if not os.path.isdir(folder):
        raise BusKeyError(f"bus key folder {folder} does not exist (create it with `rollbus keys {folder}`)")
    client_public, client_secret = _read(os.path.join(folder, "client.key_secret"), secret=True)
    server_secret = None
    if server:
        server_public, server_secret = _read(os.path.join(folder, "server.key_secret"), secret=True)
    else:
        server_public, _ = _read(os.path.join(folder, "server.key"), secret=False)
    allowed = {client_public}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".key") and name != "server.key":
            allowed.add(_read(os.path.join(folder, name), secret=False)[0])
    return BusKeys(server_public, client_public, client_secret, server_secret, frozenset(allowed), folder)


# ------------------------------------------------------------------------------------ policy


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def env_insecure() -> bool:
    return os.environ.get(ENV_INSECURE, "") not in ("", "0")


def check_config(cfg) -> BusKeys | None:
    """Start-up check of the bus flags (raises ValueError naming the flag or file); the keys, or None."""
    curve_dir, insecure = cfg.bus.bus_curve_dir, cfg.bus.bus_insecure
    if cfg.bus.bus_transport != "tcp":
        if curve_dir or insecure:
            raise ValueError("--bus-curve-dir and --bus-insecure concern --bus-transport tcp only "
                             "(ipc sockets are protected by their folder's permissions)")
        return None
    if cfg.bus.bus_dir:
        raise ValueError("--bus-dir (or ROLLBUS_BUS_DIR) sets the folder of ipc sockets and has no effect with "
                         "--bus-transport tcp: drop it")
    if curve_dir and insecure:
        raise ValueError("--bus-curve-dir and --bus-insecure contradict each other: choose one")
    if curve_dir:
        return load(curve_dir, server=True)
    if not insecure:
        raise ValueError("--bus-transport tcp needs keys: create them with `rollbus keys DIR` and pass "
                         "--bus-curve-dir DIR (or, on a loopback --bus-host only, --bus-insecure)")
    if not is_loopback(cfg.bus.bus_host):
        raise ValueError(f"--bus-insecure is refused with --bus-host {cfg.bus.bus_host}: an unauthenticated bus "
                         "may only listen on a loopback address; use --bus-curve-dir")
    return None


# ------------------------------------------------------------------------------------ sockets

_KEYS: "weakref.WeakKeyDictionary[zmq.Context, BusKeys]" = weakref.WeakKeyDictionary()
_AUTH: "weakref.WeakKeyDictionary[zmq.Context, ThreadAuthenticator]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def attach(ctx: zmq.Context, keys: BusKeys | None) -> None:
    """Every tcp socket made in ctx by bus.sockets.make_socket from now on uses these keys."""
    if keys is not None:
        _KEYS[ctx] = keys


class _AllowList:
    def __init__(self, keys: BusKeys):
        self.allowed = keys.allowed
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if key not in self._refused and len(self._refused) < 1000:  # one line per key, not per retry
            self._refused.add(key)
            log.warning("bus.peer_refused", reason="public key not in the allow-list", key=key[:8].decode())
        return False


def _authenticator(ctx: zmq.Context, keys: BusKeys) -> None:
    with _LOCK:
        if ctx in _AUTH:
            return
        auth = ThreadAuthenticator(ctx, log=_quiet_logger())
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_AllowList(keys))
        _AUTH[ctx] = auth


def _quiet_logger():
    import logging

    return logging.getLogger("rollbus.bus.zap")


def secure_socket(ctx: zmq.Context, sock: zmq.Socket, *, server: bool) -> None:
    """Apply ctx's keys to sock before it binds (server) or connects (client)."""
    keys = _KEYS.get(ctx)
    if keys is None:
        return
    if server:
        if keys.server_secret is None:
            raise BusKeyError(f"{keys.folder}: binding a tcp bus socket needs server.key_secret")
        _authenticator(ctx, keys)
        sock.zap_domain = ZAP_DOMAIN
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
    else:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public


def stop(ctx: zmq.Context) -> None:
    """Stop ctx's ZAP handler (before ctx.destroy)."""
    auth = _AUTH.pop(ctx, None)
    if auth is not None:
        auth.stop()
