"""The credentials a replica or cache agent reads on its own node, so that none of them travels
in a Serve config or an actor's arguments (Ray's GCS keeps both, readable by every Ray job).

A config section (``actors.replica_config``) names where each one is: a directory's
``password_env`` (an env var), the agents' ``token_file`` (a 0600 file) or ``token_env``. A
literal ``password`` / ``token`` is still taken (tests, and the Ray-KV fallback token of a
deploy that names none).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cachedir.hashing import read_secret

if TYPE_CHECKING:
    from actors.replica_config import AgentSection, DirectorySection

__all__ = ["agent_token", "directory_password"]


def _env(name: str | None, field: str) -> str | None:
    if not name:
        return None
    if name not in os.environ:
        raise ValueError(f"{field} names {name!r}, which is not set on this node")
    return os.environ[name]


def directory_password(directory: DirectorySection) -> str | None:
    """The Redis password of ``directory`` (None: Redis needs none)."""
    return directory.password or _env(directory.password_env, "directory_password_env")


def agent_token(agents: AgentSection) -> str | None:
    """The cluster's cache-agent token (None: agents serve without authentication)."""
    if agents.token:
        return agents.token
    if agents.token_file:
        return read_secret(agents.token_file, "agent token").decode()
    return _env(agents.token_env, "agent_token_env")
