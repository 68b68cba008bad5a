"""``CacheAgent``: the Ray shell of a node's cache agent (``cachedir.agent.NodeAgent``).

One named, detached actor per node (``tideserve-cache-agent-<node id>`` in namespace
``tideserve``), pinned to its node with a hard node-affinity strategy and restarted by Ray if
its process dies. ``ensure_cache_agents`` creates the missing ones and is idempotent; replicas call
it on start and periodically, so a node added later gets its agent too. The agent keeps running
while its node is lent to training, so its units stay fetchable.

Its config is an ``actors.replica_config.AgentSection`` (store, directory, token, TLS,
replication and timings).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.credentials import agent_token
from actors.replica_config import AgentSection
from cachedir.agent.client import AgentClient, AgentError
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import ServerConfig
from cachedir.keeping import KeepBudget
from cachedir.node_cache import CacheConfig
from cachedir.replication import ReplicationConfig
from cachedir.store import StoreConfig

__all__ = ["CacheAgent", "NodeAgentClient", "agent_handles", "agent_name", "agents_stats", "ensure_cache_agents", "keep_units_of",
           "warm_nodes", "NAMESPACE"]

log = logging.getLogger(__name__)

NAMESPACE = "tideserve"


def agent_name(node_id: str) -> str:
    return f"tideserve-cache-agent-{node_id}"


def node_cache_dir(cache_dir: str, node_id: str) -> Path:
    return Path(cache_dir.replace("{node}", node_id[:12]))


def tls_files(cfg: AgentSection) -> dict[str, bytes | None]:
    """The agent TLS material ``cfg`` names (read on the node that uses it)."""
    paths = {"cert": cfg.tls_cert_file, "key": cfg.tls_key_file, "ca": cfg.tls_ca_file}
    return {name: Path(path).read_bytes() if path else None for name, path in paths.items()}


def client_certificate(cfg: AgentSection, tls: dict[str, bytes | None]) -> tuple[bytes, bytes] | None:
    """(key, chain) that this node's clients present under ``tls_mutual``."""
    if not cfg.tls_mutual:
        return None
    if tls["cert"] is None or tls["ca"] is None:
        raise ValueError("tls_mutual needs tls_cert_file, tls_key_file and tls_ca_file")
    return tls["key"], tls["cert"]


class CacheAgent:
    def __init__(self, cfg: AgentSection) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        replication = None
        if cfg.replicas > 1:
            replication = ReplicationConfig(replicas=cfg.replicas, min_hits=cfg.replication_min_hits,
                                            bytes_per_s=cfg.replication_bytes_per_s)
        tls = tls_files(cfg)
        host = ray.util.get_node_ip_address()  # bound to the node's cluster address only
        st = cfg.store
        store = StoreConfig(node_cache_dir(st.cache_dir, node_id), st.ssd_bytes, eviction=st.eviction,
                            max_age_s=st.max_age_s, layout=st.layout)
        self.agent = NodeAgent(AgentConfig(
            node_id, CacheConfig(store, ram_bytes=st.ram_bytes),
            ServerConfig(host=host, token=agent_token(cfg), tls_cert_chain=tls["cert"], tls_private_key=tls["key"],
                         tls_client_ca=tls["ca"] if cfg.tls_mutual else None),
            advertise_host=host, tls_root_certificates=tls["ca"], tls_client_certificate=client_certificate(cfg, tls),
            heartbeat_ttl_s=cfg.heartbeat_ttl_s, sync_every_s=cfg.sync_every_s, replication=replication,
        ), cfg.directory.open())
        self.agent.sync_once()  # registered and heartbeating before anyone asks
        # before this node's replica serves (it waits for its agent): the hot units it lacks
        self.warmed = self.warm(cfg.warm_bytes, cfg.warm_s) if cfg.warm_bytes else None

    def info(self) -> dict:
        return {"node_id": self.agent.node_id, "address": self.agent.address, "warmed": self.warmed}

    def stats(self) -> dict:
        return self.agent.stats()

    def evict(self, keys_hex: list[str] | None = None) -> int:
        """Drop the given units (hex keys), or every unit when None (``tide cache evict``)."""
        keys = [bytes.fromhex(k) for k in keys_hex] if keys_hex is not None else self.agent.cache.ssd.keys()
        return self.agent.evict(keys)

    def explain(self, keys_hex: list[str]) -> dict[str, list[str]]:
        """For each unit (hex key): the tier this node holds it in ("" where not) and, where not,
        why it was dropped here recently ("evicted", "removed", "damaged"; "" when it never was
        here or long ago)."""
        keys = [bytes.fromhex(k) for k in keys_hex]
        return {"tiers": self.agent.cache.has(keys), "gone": self.agent.cache.ssd.gone(keys)}

    def pin(self, keys_hex: list[str], unpin: bool = False) -> int:
        """Pin (or unpin) the units this node holds among ``keys_hex``; returns how many."""
        keys = [bytes.fromhex(k) for k in keys_hex]
        ssd = self.agent.cache.ssd
        return ssd.unpin(keys) if unpin else ssd.pin(keys)

    def sync(self) -> None:
        self.agent.sync_once()

    def keep(self, leaving: list[str], max_bytes: int, deadline_s: float) -> dict[str, int]:
        """This node leaves serving with ``leaving``: copy its hot units that only they hold to
        the nodes that stay (``cachedir.keeping``)."""
        return self.agent.keep(leaving, KeepBudget(max_bytes=max_bytes, deadline_s=deadline_s))

    def warm(self, max_bytes: int, deadline_s: float) -> dict[str, int]:
        """This node serves again: fetch the hot units it lacks from their holders."""
        return self.agent.warm(KeepBudget(max_bytes=max_bytes, deadline_s=deadline_s))


def ensure_cache_agents(cfg: AgentSection, timeout_s: float = 120.0) -> dict[str, ray.actor.ActorHandle]:
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


def keep_units_of(nodes: list[str], max_bytes: int, deadline_s: float, timeout_s: float) -> dict[str, dict[str, int]]:
    """Before ``nodes`` leave serving (lent at night): each one's agent copies its hot units that
    only they hold to the nodes that stay (``cachedir.keeping``), side by side, within
    ``max_bytes`` a node and ``deadline_s``."""
    return _on_agents(nodes, lambda agent: agent.keep.remote(nodes, max_bytes, deadline_s),
                      min(timeout_s, deadline_s + 30.0))


def warm_nodes(nodes: list[str], max_bytes: int, deadline_s: float, timeout_s: float) -> dict[str, dict[str, int]]:
    """``nodes`` serve again: each one's agent fetches the hot units it lacks (then the fleet's
    others, budget left), side by side."""
    return _on_agents(nodes, lambda agent: agent.warm.remote(max_bytes, deadline_s), min(timeout_s, deadline_s + 30.0))


def _on_agents(nodes: list[str], call: Callable, timeout_s: float) -> dict[str, dict[str, int]]:
    """``call`` on each node's agent (those that have one), their answers by node. A node whose
    agent cannot answer is left out (its units are misses): keeping never stops a night or a
    morning."""
    agents = agent_handles()
    refs = {node: call(agents[node]) for node in nodes if node in agents}
    out = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - keeping is best effort; said in the log
            log.warning("the cache agent of node %s could not keep or warm its units: %s", node, e)
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

    def push(self, encoded_units: Iterable[bytes], replace: frozenset[int] = frozenset()) -> tuple[int, int]:
        """``AgentClient.push``; the units are read once, so a retry at a restarted agent sends
        them all again (a generator would be spent by the failed try)."""
        units = list(encoded_units)
        return self.__getattr__("push")(units, replace=replace)

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
