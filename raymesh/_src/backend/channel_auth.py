"""Channel frames signed with the cluster's key: the key itself (kept in Ray's GCS), the
HMAC-SHA256 every frame carries, and the count of frames dropped for a wrong one. What it
guarantees is said in `channel`'s docstring: only frames from processes of this Ray cluster
are unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["REPLY", "REQUEST", "Drops", "Mac", "current_mac", "runtime_key", "runtime_mac"]

# Each frame's MAC covers what it is (a message or a reply: one is never taken for the other),
# the length of each part, then the parts.
REQUEST, REPLY = b"raymesh-channel-message\0", b"raymesh-channel-reply\0"
_KEY_NAME, _KEY_NAMESPACE = b"channel-key", "raymesh"  # where Ray's GCS keeps the key
JOIN_BELOW = 64 << 10  # parts shorter than this in all are joined and hashed in one call
_DROP_LOG_S = 60.0  # dropped frames are logged at most this often

logger = logging.getLogger("raymesh")


_key_lock = threading.Lock()
_key: tuple[Any, bytes, Mac] | None = None  # (the GCS connection it came from, the key, its MAC)


def runtime_key() -> bytes:
    """This Ray cluster's channel key (see the module's guarantees): read from Ray's GCS once
    per connection, made there by the first process that asks (`overwrite=False`: two processes
    asking at once both get the first one's). A process that connects to another cluster (a
    `shutdown()`, then a new local Ray) reads that cluster's key. RuntimeError when this process
    is not connected to Ray."""
    return runtime_mac().key


def runtime_mac() -> Mac:
    from ray.experimental import internal_kv

    global _key
    gcs = internal_kv.internal_kv_get_gcs_client()
    cached = _key
    if cached is not None and cached[0] is gcs:
        return cached[2]
    with _key_lock:
        if gcs is None:
            raise RuntimeError("channels need this process connected to Ray: it holds their key")
        key = internal_kv._internal_kv_get(_KEY_NAME, namespace=_KEY_NAMESPACE)
        if key is None:
            new = secrets.token_bytes(32)
            internal_kv._internal_kv_put(_KEY_NAME, new, overwrite=False, namespace=_KEY_NAMESPACE)
            key = internal_kv._internal_kv_get(_KEY_NAME, namespace=_KEY_NAMESPACE)
        if not isinstance(key, bytes) or len(key) < 32:
            raise RuntimeError(
                f"Ray's GCS holds no usable channel key under {_KEY_NAMESPACE}/{_KEY_NAME!r} "
                "(it must be at least 32 bytes): set RAYMESH_CHANNELS=0 to send every message "
                "through Ray"
            )
        mac = Mac(key)
        _key = (gcs, key, mac)
        return mac


def current_mac() -> Mac | None:
    """The MAC of the key this process read last (None: none yet), without asking Ray."""
    return _key[2] if _key else None


_LENGTHS = {n: struct.Struct(f"<{n}Q") for n in (3, 4)}  # a reply's and a message's lengths
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


class Mac:
    """HMAC-SHA256 (RFC 2104) under one key, of a frame's kind and parts (each part's length
    first, so that no two frames read alike): 3 parts (a reply) or 4 (a message), the large
    one, if any, last. The padded key's two hash states are made once: a frame's MAC is then
    two copies and two updates, about 3 us here, where `hmac.digest` spends about 4 us a call
    on OpenSSL's key setup alone (a round trip makes four MACs)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        padded = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
        self._inner = hashlib.sha256(padded.translate(_IPAD))
        self._outer = hashlib.sha256(padded.translate(_OPAD))

    def __call__(self, kind: bytes, parts: Sequence[bytes]) -> bytes:
        inner = self._inner.copy()
        lengths = _LENGTHS[len(parts)].pack(*map(len, parts))
        if len(parts[-1]) < JOIN_BELOW:  # the common, small message: one call
            inner.update(kind + lengths + b"".join(parts))
        else:  # a large payload (always the last part): hashed where it lies, not copied
            inner.update(kind + lengths)
            for part in parts:
                inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def signed(mac: Mac, kind: bytes, parts: list[bytes]) -> list[bytes]:
    return [mac(kind, parts), *parts]


def verified(mac: Mac, kind: bytes, frames: list[bytes], count: int) -> list[bytes] | None:
    """The parts of a frame of `count` parts, when its MAC is right; None otherwise."""
    if len(frames) != count + 1:
        return None
    parts = frames[1:]
    return parts if hmac.compare_digest(frames[0], mac(kind, parts)) else None


class Drops:
    """Frames dropped for a missing or wrong MAC (never unpickled): counted, and logged when
    the first arrives and then at most every `_DROP_LOG_S` seconds, so that a flood of them
    cannot flood the log. The frames themselves are never logged."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0
        self._unlogged = 0
        self._next_log = 0.0
        self._lock = threading.Lock()

    def add(self, frames: list[bytes]) -> None:
        with self._lock:
            self.count += 1
            self._unlogged += 1
            now = time.monotonic()
            if now < self._next_log:
                return
            self._next_log = now + _DROP_LOG_S
            n, self._unlogged = self._unlogged, 0
        logger.warning(
            "raymesh: dropped %d frame(s) sent to %s without this Ray cluster's channel key "
            "(last: %d part(s), %d bytes), unread: a process outside the cluster wrote to its "
            "socket; at most one such line every %g s",
            n,
            self.where,
            len(frames),
            sum(map(len, frames)),
            _DROP_LOG_S,
        )
