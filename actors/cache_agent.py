"""``CacheAgent``: the Ray shell of a node's cache agent (``cachedir.agent.NodeAgent``).

One named, detached actor per node (``tideserve-cache-agent-<node id>`` in namespace
``tideserve``), pinned to its node with a hard node-affinity strategy and restarted by Ray if
its process dies. ``ensure_cache_agents`` creates the missing ones and is idempotent; replicas call
it on start and periodically, so a node added later gets its agent too. The agent keeps running
while its node is lent to training, so its units stay fetchable.

``cfg`` keys: ``cache_dir`` (``{node}`` is replaced by the node id's first 12 characters — needed
when several simulated nodes share one disk), ``ssd_bytes``, ``store_layout`` (``unit`` | ``segment``),
``ram_bytes``, ``eviction``,
``max_age_s``, ``directory_url``, ``directory_namespace``, ``directory_password_env``, ``directory_ca_file``,
``agent_token_file`` / ``agent_token_env`` (``actors.credentials``: read on the node), ``tls_cert_file``/``tls_key_file``
(PEM: the agent serves TLS) and ``tls_ca_file`` (PEM: clients verify agents with it), ``tls_mutual``
(agents and replicas present the node's certificate and agents require one signed by the CA), ``heartbeat_ttl_s``, ``sync_every_s``, ``replicas`` (R; 1 turns replication
off), ``replication_min_hits``, ``replication_bytes_per_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.credentials import agent_token, directory_password
from cachedir.agent.client import AgentClient, AgentError
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import ServerConfig
from cachedir.directory import open_directory
from cachedir.node_cache import CacheConfig
from cachedir.replication import ReplicationConfig
from cachedir.store import StoreConfig

__all__ = ["CacheAgent", "NodeAgentClient", "agent_handles", "agent_name", "agents_stats", "ensure_cache_agents",
           "NAMESPACE"]

NAMESPACE = "tideserve"


def agent_name(node_id: str) -> str:
    return f"tideserve-cache-agent-{node_id}"


def node_cache_dir(cache_dir: str, node_id: str) -> Path:
    return Path(cache_dir.replace("{node}", node_id[:12]))


def tls_files(cfg: dict) -> dict[str, bytes | None]:
    """The agent TLS material named in ``cfg`` (read on the node that uses it)."""
    out = {}
    for name in ("cert", "key", "ca"):
        path = cfg.get(f"tls_{name}_file")
        out[name] = Path(path).read_bytes() if path else None
    return out


def client_certificate(cfg: dict, tls: dict[str, bytes | None]) -> tuple[bytes, bytes] | None:
    """(key, chain) that this node's clients present under ``tls_mutual``."""
    if not cfg.get("tls_mutual"):
        return None
    if tls["cert"] is None or tls["ca"] is None:
        raise ValueError("tls_mutual needs tls_cert_file, tls_key_file and tls_ca_file")
    return tls["key"], tls["cert"]


class CacheAgent:
    def __init__(self, cfg: dict) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        directory = None
        if cfg.get("directory_url"):
            directory = open_directory(cfg["directory_url"], cfg.get("directory_namespace") or NAMESPACE,
                                       password=directory_password(cfg), ssl_ca_certs=cfg.get("directory_ca_file"))
        replicas = int(cfg.get("replicas", 2))
        replication = None
        if replicas > 1:
            replication = ReplicationConfig(replicas=replicas, min_hits=float(cfg.get("replication_min_hits", 2.0)),
                                            bytes_per_s=float(cfg.get("replication_bytes_per_s", 100e6)))
        tls = tls_files(cfg)
        host = ray.util.get_node_ip_address()  # bound to the node's cluster address only
        store = StoreConfig(node_cache_dir(cfg["cache_dir"], node_id), int(cfg.get("ssd_bytes", 8 << 30)),
                            eviction=cfg.get("eviction", "lru"), max_age_s=cfg.get("max_age_s"),
                            layout=cfg.get("store_layout", "segment"))
        self.agent = NodeAgent(AgentConfig(
            node_id, CacheConfig(store, ram_bytes=int(cfg.get("ram_bytes", 512 << 20))),
            ServerConfig(host=host, token=agent_token(cfg), tls_cert_chain=tls["cert"], tls_private_key=tls["key"],
                         tls_client_ca=tls["ca"] if cfg.get("tls_mutual") else None),
            advertise_host=host, tls_root_certificates=tls["ca"], tls_client_certificate=client_certificate(cfg, tls),
            heartbeat_ttl_s=float(cfg.get("heartbeat_ttl_s", 10.0)),
            sync_every_s=float(cfg.get("sync_every_s", 0.25)), replication=replication,
        ), directory)
        self.agent.sync_once()  # registered and heartbeating before anyone asks

    def info(self) -> dict:
        return {"node_id": self.agent.node_id, "address": self.agent.address}

    def stats(self) -> dict:
        return self.agent.stats()

    def evict(self, keys_hex: list[str] | None = None) -> int:
        """Drop the given units (hex keys), or every unit when None (``tide cache evict``)."""
        keys = [bytes.fromhex(k) for k in keys_hex] if keys_hex is not None else self.agent.cache.ssd.keys()
        return self.agent.evict(keys)

    def pin(self, keys_hex: list[str], unpin: bool = False) -> int:
        """Pin (or unpin) the units this node holds among ``keys_hex``; returns how many."""
        keys = [bytes.fromhex(k) for k in keys_hex]
        ssd = self.agent.cache.ssd
        return ssd.unpin(keys) if unpin else ssd.pin(keys)

    def sync(self) -> None:
        self.agent.sync_once()


def ensure_cache_agents(cfg: dict, timeout_s: float = 120.0) -> dict[str, ray.actor.ActorHandle]:
    """The agent of every alive node (created where missing), by node id, each ready."""
    handles = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        handles[node_id] = ray.remote(CacheAgent).options(
            name=agent_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(cfg)
    ray.get([h.info.remote() for h in handles.values()], timeout=timeout_s)
    return handles


def agent_handles() -> dict[str, ray.actor.ActorHandle]:
    """Node id -> the cache agent of every alive node that has one (this process must be
    connected to the cluster)."""
    out = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            out[node["NodeID"]] = ray.get_actor(agent_name(node["NodeID"]), namespace=NAMESPACE)
        except ValueError:  # no agent on that node (yet)
            continue
    return out


def agents_stats(timeout_s: float = 60.0) -> dict[str, dict]:
    """Node id -> its agent's stats (units, bytes and pins per tier, hits, fetches, replication)."""
    handles = agent_handles()
    stats = ray.get([h.stats.remote() for h in handles.values()], timeout=timeout_s)
    return dict(zip(handles, stats, strict=True))


class NodeAgentClient:
    """A client of this node's agent that follows it across restarts: Ray restarts a dead agent,
    which then listens on a new port; a call that fails asks the agent actor for its address and,
    when it changed, is made once more there. (Other nodes' agents are found through the
    directory, where a restarted agent publishes its new address.)"""

    def __init__(self, node_id: str, make: Callable[[str], AgentClient], timeout_s: float = 5.0) -> None:
        self._node_id, self._make, self._timeout_s = node_id, make, timeout_s
        self._client = make(self._resolve())

    def _resolve(self) -> str:
        agent = ray.get_actor(agent_name(self._node_id), namespace=NAMESPACE)
        return ray.get(agent.info.remote(), timeout=self._timeout_s)["address"]

    @property
    def address(self) -> str:
        return self._client.address

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            try:
                return getattr(self._client, name)(*args, **kwargs)
            except AgentError as e:
                try:
                    address = self._resolve()
                except Exception:  # noqa: BLE001 - the agent is still restarting: this call is a miss
                    raise e from None
                if address == self._client.address:
                    raise
                self._client = self._make(address)
                return getattr(self._client, name)(*args, **kwargs)
        return call
