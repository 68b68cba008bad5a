"""The ingress's configuration: frozen, built once by ``deploy.app.build_app``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from actors.replica_config import DirectorySection
from cluster.cache_identity import CacheIdentity
from deploy.limits import KeyGrant, Limits

__all__ = ["IngressConfig"]


@dataclass(frozen=True)
class IngressConfig:
    """``identity``: the model and its cache identity, the replicas' own (the ingress hashes
    prompts in its namespace). ``api_keys``: {key: "TENANT[:MODEL+...]"}, None: no keys.
    ``directory``: with a URL each prompt is planned for the cache-aware router.
    ``public_paths``: paths served without a key besides /health and /version.
    ``structured_whitespace``: "any" lets structured JSON hold runs of whitespace.
    ``batch_state``: the Redis that keeps batch jobs and files' records (no URL: this ingress's
    memory); ``files_dir``: where file bodies are kept (None: no Files or Batch API)."""

    identity: CacheIdentity
    model_name: str
    limits: Limits = field(default_factory=Limits)
    api_keys: dict[str, str] | None = None
    directory: DirectorySection = DirectorySection()
    public_paths: tuple[str, ...] = ()
    expert_parallel: bool = False  # /metrics reports the expert placement
    structured_whitespace: Literal["compact", "any"] = "compact"
    batch_state: DirectorySection = DirectorySection()
    files_dir: str | None = None

    def __post_init__(self) -> None:
        if self.structured_whitespace not in ("compact", "any"):
            raise ValueError(f"structured_whitespace must be compact or any, got {self.structured_whitespace!r}")
        for grant in (self.api_keys or {}).values():
            KeyGrant.parse(grant)  # a bad grant fails here, not on the first request

    @property
    def checkpoint(self) -> str:
        return self.identity.checkpoint

    def grants(self) -> dict[str, KeyGrant] | None:
        return {k: KeyGrant.parse(v) for k, v in self.api_keys.items()} if self.api_keys else None

    @property
    def grammar_limits(self) -> tuple[int, bool]:
        """A structured output's largest grammar in bytes, and whether its JSON may hold any whitespace."""
        return self.limits.max_grammar_bytes, self.structured_whitespace == "any"
