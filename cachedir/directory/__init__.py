"""Directory backends, chosen by URL scheme: ``mem://`` (in-process), ``redis://``/``rediss://``
(one Redis) or ``redis+cluster://``/``rediss+cluster://`` (a Redis Cluster, from seed addresses)."""

from __future__ import annotations

from cachedir.directory.base import (
    Directory,
    DirectoryUnavailable,
    Holder,
    HotUnit,
    PrefixMatch,
)

__all__ = [
    "Directory",
    "DirectoryUnavailable",
    "Holder",
    "HotUnit",
    "PrefixMatch",
    "open_directory",
]

SCHEMES = ("mem", "redis", "rediss", "redis+cluster", "rediss+cluster")


def open_directory(url: str, namespace: str, password: str | None = None, ssl_ca_certs: str | None = None,
                   **options) -> Directory:
    """A directory for ``url``; unknown schemes raise and list the supported ones. ``password``
    (Redis AUTH; None: none or the one in the URL) and ``ssl_ca_certs`` (a PEM CA file that
    signed the server's certificate, for ``rediss://``) are ignored by ``mem://``. A cluster URL
    lists one or more of its nodes: ``redis+cluster://:password@10.0.0.1:7000,10.0.0.2:7000``."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme == "mem":
        from cachedir.directory.memory import MemoryDirectory

        return MemoryDirectory(namespace, **options)
    if scheme in SCHEMES:
        from cachedir.directory.redis_backend import RedisDirectory

        return RedisDirectory(url, namespace, password=password, ssl_ca_certs=ssl_ca_certs, **options)
    raise ValueError(f"unsupported directory URL {url!r}; supported schemes: {', '.join(SCHEMES)}")
