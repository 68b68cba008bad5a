"""The credentials a replica or cache agent reads on its own node, so that none of them travels
in a Serve config or an actor's arguments (Ray's GCS keeps both, readable by every Ray job).

A config names where each one is: ``directory_password_env`` (an env var), ``agent_token_file``
(a 0600 file) or ``agent_token_env``. A literal ``directory_password`` / ``agent_token`` is still
taken (tests, and the Ray-KV fallback token of a deploy that names none).
"""

from __future__ import annotations

import os

from cachedir.hashing import read_secret

__all__ = ["agent_token", "directory_password"]


def _env(cfg: dict, field: str) -> str | None:
    name = cfg.get(field)
    if not name:
        return None
    if name not in os.environ:
        raise ValueError(f"{field} names {name!r}, which is not set on this node")
    return os.environ[name]


def directory_password(cfg: dict) -> str | None:
    """The Redis password of ``cfg``'s directory (None: Redis needs none)."""
    return cfg.get("directory_password") or _env(cfg, "directory_password_env")


def agent_token(cfg: dict) -> str | None:
    """The cluster's cache-agent token (None: agents serve without authentication)."""
    if cfg.get("agent_token"):
        return cfg["agent_token"]
    if cfg.get("agent_token_file"):
        return read_secret(cfg["agent_token_file"], "agent token").decode()
    return _env(cfg, "agent_token_env")
