"""`Tls`: the certificate and key a server uses for HTTPS (raymesh.serve, raymesh.federated's
edge server and raymesh.dashboard take the same one)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Tls"]


@dataclass(frozen=True, kw_only=True)
class Tls:
    """HTTPS for a server: a PEM certificate (chain) and its private key, as uvicorn's
    `ssl_certfile` / `ssl_keyfile`. Both files must exist when the config is made."""

    cert: str
    key: str

    def __post_init__(self) -> None:
        for name, path in (("cert", self.cert), ("key", self.key)):
            if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
                raise ValueError(
                    f"tls.{name}={path!r} is not a file: give the path of a PEM "
                    f"{'certificate' if name == 'cert' else 'private key'}"
                )

    @classmethod
    def of(cls, cert: str | None, key: str | None) -> Tls | None:
        """`Tls` from two optional paths (a CLI's --tls-cert/--tls-key): both or neither."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            missing = "tls_cert" if cert is None else "tls_key"
            raise ValueError(f"{missing} is missing: HTTPS needs both a certificate and its key")
        return cls(cert=str(cert), key=str(key))
