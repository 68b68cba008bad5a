"""What a replica is built from: one frozen ``ReplicaConfig`` that ``deploy.app.build_app`` makes
once from ``AppArgs`` and every ``LLMServer`` (and the cache agents it starts) reads as it is.

Sections: ``engine`` (``cluster.engine.EngineConfig``), ``store`` (the node's unit store),
``directory`` (the Redis directory), ``agents`` (the per-node cache agents; None: the replica
keeps its own store) and ``ep`` (expert parallelism; None: the replica runs its own experts).
Each default lives in one place: here, or in the type a section wraps. Secrets travel by name
(an env var, a 0600 file) and are read on the node (``actors.credentials``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cache agents and the admin commands read these sections without torch
    from cluster.cache_identity import CacheIdentity
    from cluster.engine_config import EngineConfig

__all__ = ["AgentSection", "DirectorySection", "EPSection", "ReplicaConfig", "StoreSection"]

DEFAULT_NAMESPACE = "tideserve"  # the directory's namespace: one per cluster, several models share it


@dataclass(frozen=True, slots=True)
class DirectorySection:
    """The cache directory: its URL (None: no directory), namespace, password (by env var name;
    a literal ``password`` for tests) and the CA file of a ``rediss://`` server."""

    url: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    password_env: str | None = None
    password: str | None = None
    ca_file: str | None = None

    def open(self):
        """The directory client (None without a URL); the password is read here, on the node."""
        if not self.url:
            return None
        from actors.credentials import directory_password
        from cachedir.directory import open_directory

        return open_directory(self.url, self.namespace, password=directory_password(self), ssl_ca_certs=self.ca_file)


@dataclass(frozen=True, slots=True)
class StoreSection:
    """A node's unit store: ``cache_dir`` (``{node}`` becomes the node id's first 12 characters,
    for simulated nodes sharing one disk), the SSD and RAM budgets, file layout, admission and
    eviction."""

    cache_dir: str
    ssd_bytes: int = 8_000_000_000
    layout: str = "segment"  # "unit" | "segment"
    ram_bytes: int = 512 << 20
    admission: str = "all"
    eviction: str = "lru"
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("unit", "segment"):
            raise ValueError(f"store layout must be unit or segment, got {self.layout!r}")
        if self.ssd_bytes <= 0 or self.ram_bytes < 0:
            raise ValueError(f"store budgets must be positive, got ssd {self.ssd_bytes}, ram {self.ram_bytes}")


@dataclass(frozen=True, slots=True)
class AgentSection:
    """The per-node cache agents (``actors.cache_agent``): their store and directory, the
    token (by file or env var; a literal only where a test builds one), TLS files (PEM on every
    node), replication (``replicas`` copies of a hot unit; 1: none) and timings."""

    store: StoreSection
    directory: DirectorySection = DirectorySection()
    token: str | None = None
    token_file: str | None = None
    token_env: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_mutual: bool = False
    replicas: int = 2
    replication_min_hits: float = 2.0
    replication_bytes_per_s: float = 100e6
    heartbeat_ttl_s: float = 10.0
    sync_every_s: float = 0.25
    fetch_timeout_s: float = 5.0  # a replica's fetch from an agent
    check_s: float = 30.0  # how often a replica makes sure every node has its agent
    # an agent that starts on a node (a node joining, or back in the morning) first fetches the
    # fleet's hot units it lacks, then its others, at most this many bytes within this many seconds
    # (0: it does not)
    warm_bytes: int = 0
    warm_s: float = 60.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"agent replicas must be >= 1, got {self.replicas}")
        if self.tls_mutual and not self.tls_ca_file:
            raise ValueError("tls_mutual needs tls_ca_file (the CA that signs the nodes' certificates)")


@dataclass(frozen=True, slots=True)
class EPSection:
    """Expert parallelism: the app's ``EPControl`` actor (it owns the expert shards and the
    placement), how long an expert round may take before its shard counts as failed, and how
    rows travel (``wire``: "fp8" dispatches in FP8 and combines in BF16, as DeepSeek serves V3;
    "native" sends the model's dtype both ways; "auto" is fp8 for a BF16 model, else native), and
    what moves them (``backend``)."""

    control: object
    timeout_s: float = 30.0
    wire: str = "auto"
    backend: str = "auto"  # what moves the rows: nccl | gloo | auto (``cluster.ep_comm.group_backend``)

    def __post_init__(self) -> None:
        if self.wire not in ("auto", "native", "fp8"):
            raise ValueError(f"ep wire must be auto, native or fp8, got {self.wire!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"ep backend must be auto, gloo or nccl, got {self.backend!r}")


def _engine_config() -> EngineConfig:
    from cluster.engine_config import EngineConfig

    return EngineConfig()


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One ``LLMServer`` replica. ``warmup`` None: on CUDA only. ``enable_cache`` False: no unit
    store, and no prefix sharing whatever ``engine`` says (benchmarks' baseline). ``usage_dir``: per-request usage logs
    (``tide stats``). ``tidal``: follow the day/night role of its node."""

    checkpoint: str
    store: StoreSection
    dtype: str = "float32"
    device: str = "cpu"
    cpu_weights: str = "fp32"  # "int8": a CPU replica holds its projections and experts in 8 bits
    fp8_weights: str = "auto"  # an fp8 checkpoint's weights: auto (kept on CUDA) | keep | dequantize
    cpu_threads: int | None = None  # a CPU replica's torch threads (None: Ray's, one per CPU it reserves)
    # the least time between a stream's outputs (cluster.engine_loop); the serving default: as Ray
    # Serve LLM's setting of this name, each output being a hop through the replica, the ingress
    # and the HTTP proxy (~1.5 ms of CPU)
    stream_batching_interval_ms: float = 50.0
    warmup: bool | None = None
    engine: EngineConfig = field(default_factory=_engine_config)
    enable_cache: bool = True
    directory: DirectorySection = DirectorySection()
    agents: AgentSection | None = None
    ep: EPSection | None = None
    usage_dir: str | None = None
    cache_secret_file: str | None = None
    tidal: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.cpu_weights not in ("fp32", "int8"):
            raise ValueError(f"cpu_weights must be fp32 or int8, got {self.cpu_weights!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if not self.stream_batching_interval_ms >= 0:
            raise ValueError(f"stream_batching_interval_ms must be >= 0, got {self.stream_batching_interval_ms}")
        if self.cpu_weights == "int8" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"cpu_weights int8 needs device cpu and dtype float32, got {self.device} {self.dtype}")
        if self.fp8_weights not in ("auto", "keep", "dequantize"):
            raise ValueError(f"fp8_weights must be auto, keep or dequantize, got {self.fp8_weights!r}")

    @property
    def identity(self) -> CacheIdentity:
        """What this replica's cache units are keyed by (the ingress plans prompts in it too)."""
        from cluster.cache_identity import CacheIdentity

        return CacheIdentity(self.checkpoint, self.dtype, self.device, self.cpu_weights, self.fp8_weights,
                             self.cache_secret_file, self.drafts)

    @property
    def drafts(self) -> bool:
        """Whether the replicas load the checkpoint's MTP layers and draft with them (under expert
        parallelism their experts are on the shards with the others)."""
        return self.engine.speculative_tokens > 0
