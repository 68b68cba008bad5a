"""``LLMServer``: one model replica as a Ray Serve deployment (a plain class; ``deploy/app.py``
applies ``serve.deployment``).

It owns the engine and the node's prompt cache; the engine runs in a ``cluster.engine_loop``
thread, and each ``generate`` call takes a ``GenerationRequest`` and streams its ``RequestOutput``s
back (``cluster.request``: the same frozen types on both sides of the Ray call). When
a directory URL is configured it publishes the node's units (batched, retried) and heartbeats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import ray
import torch

from actors import pd_handoff
from actors.cache_agent import NodeAgentClient, client_certificate, ensure_cache_agents, tls_files
from actors.credentials import agent_token
from actors.ep_group import EPGroup
from actors.gpu import gpu_telemetry
from actors.replica_config import AgentSection, EPSection, ReplicaConfig, StoreSection
from actors.serve_bind import bind_replica_grpc_to_node
from actors.startup import StartupReporter
from cachedir.agent.client import AgentClient, ClientPool
from cachedir.agent.cluster_cache import ClusterCache
from cachedir.hashing import read_secret
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig, StoreLocked
from cluster.engine import Engine
from cluster.engine_loop import PromptKV
from cluster.ep import Wire
from cluster.kv_transfer import KVOutbox
from cluster.replica import Replica
from cluster.request import (
    GenerationRequest,
    RequestMigrated,
    RequestOutput,
)
from kernels.cpu_gemv import cpu_kernels, kernel_state
from model.checkpoint import LoadProgress, load_model
from model.kv_sizes import kv_sizes
from model.tokenizer import load_tokenizer

__all__ = ["LLMServer"]

log = logging.getLogger(__name__)
UNIT_HEADER_SLACK = 64 << 10  # an encoded unit beyond its KV: header, token ids, MAC


def secret_warning(enable_cache: bool, secret: bytes) -> str | None:
    """What a replica logs at start when its prompt cache has no secret (b""; else None)."""
    if not enable_cache or secret:
        return None
    return ("the prompt cache has no secret (cache_secret_file): its units carry no MAC, so anyone who can write a "
            "cache directory or answer as a cache agent can plant KV that is served as valid; give "
            "cache_secret_file (tide up makes one)")
bind_replica_grpc_to_node()  # a replica imports this module before Serve opens its gRPC port


def _for_caller(o: RequestOutput) -> RequestOutput:
    """An output as it crosses to the caller: a handoff's KV tensor stays here (it is the
    stream's next item, ``actors/pd_handoff.py``)."""
    return o if o.handoff is None else o._replace(handoff=dataclasses.replace(o.handoff, kv=None))


def _actor_name() -> str | None:
    try:
        return ray.get_runtime_context().get_actor_name() or None
    except Exception:  # noqa: BLE001 - not in a Ray actor
        return None


def _load_progress(ckpt: Path, startup: StartupReporter):
    """A progress callback that logs every 10% of the bytes loaded and reports them to
    ``tide up`` (``actors.startup``)."""
    last = [-1]

    def report(p: LoadProgress) -> None:
        startup.update("loading weights", bytes=p.bytes, total_bytes=p.total_bytes, shards=p.shards,
                       total_shards=p.total_shards)
        tenth = p.bytes * 10 // max(1, p.total_bytes)
        if tenth != last[0]:
            last[0] = tenth
            log.info("loading %s: %d/%d shards, %.1f/%.1f MB", ckpt, p.shards, p.total_shards, p.bytes / 1e6,
                     p.total_bytes / 1e6)

    return report


def _own_store(store: StoreSection, base: Path) -> NodeCache:
    """This replica's own unit store (no cache agent): ``base``, or ``base.1``, ``base.2``, ...
    when other replicas on the node hold those (each directory has one store at a time; the
    same directories are found again after a restart)."""
    for slot in range(256):
        root = base if slot == 0 else base.with_name(f"{base.name}.{slot}")
        try:
            return NodeCache(CacheConfig(
                StoreConfig(root, capacity_bytes=store.ssd_bytes, eviction=store.eviction, max_age_s=store.max_age_s,
                            layout=store.layout),
                ram_bytes=store.ram_bytes, admission=store.admission,
            ))
        except StoreLocked:
            continue
    raise StoreLocked(f"every unit store under {base.parent} is in use (256 replicas on one node?)")


class LLMServer:
    def __init__(self, cfg: ReplicaConfig) -> None:
        """A replica as ``cfg`` (``actors.replica_config``) says: with ``cfg.agents`` the node's
        cache agent owns the unit store and the engine reaches every node's units through it;
        without, the replica keeps its own store under ``cfg.store.cache_dir``. With ``cfg.ep``
        the routed experts run on the expert shards of ``cfg.ep.control``."""
        if not isinstance(cfg, ReplicaConfig):
            raise TypeError(f"LLMServer takes an actors.replica_config.ReplicaConfig, got {type(cfg).__name__}")
        self._stop = False
        self._kv_outbox: KVOutbox | None = None
        self.replica_id = _actor_name() or uuid.uuid4().hex  # Serve's replica actor name, when there is one
        startup = StartupReporter(self.replica_id)
        self.model = self._load(cfg, startup)
        self.tokenizer = load_tokenizer(Path(cfg.checkpoint))
        self._secret = read_secret(cfg.cache_secret_file)
        if (warning := secret_warning(cfg.enable_cache, self._secret)) is not None:
            log.warning(warning)
        namespace = cfg.identity.namespace(self.model.cfg, self._secret)  # the ingress plans in it too
        self.node_id = f"{socket.gethostname()}-{os.getpid()}"
        self._agents = cfg.agents if cfg.enable_cache else None
        engine_cfg = cfg.engine if cfg.enable_cache else dataclasses.replace(cfg.engine, prefix_sharing=False)
        self.engine = Engine(self.model, engine_cfg, namespace, self.tokenizer.decode, self.model.cfg.eos_token_id,
                             self._prompt_cache(cfg, namespace.id), grammar_vocab=self.tokenizer.grammar_vocab)
        # the grammar compiler (xgrammar's import, the vocabulary's tokenizer info: seconds that
        # hold the GIL) is built now, not by the first constrained request beside running streams
        self.engine.constraints.grammars()
        self._last_agents = time.monotonic()
        self.replica = Replica(self.engine, self.node_id, self.tokenizer, usage_dir=cfg.usage_dir,
                               open_directory=cfg.directory.open, upkeep=self._upkeep,
                               threads=cfg.cpu_threads if cfg.device == "cpu" else None,
                               stream_batching_interval_s=cfg.stream_batching_interval_ms / 1e3)
        self.loop = self.replica.loop
        if cfg.tidal and ray.is_initialized():
            threading.Thread(target=self._tidal_loop, name="tidal", daemon=True).start()
        startup.update("ready", force=True)

    def _load(self, cfg: ReplicaConfig, startup: StartupReporter):
        """The model, its CPU kernels built, its expert-parallel group formed, its kernels warm."""
        ckpt = Path(cfg.checkpoint)
        model = load_model(ckpt, cfg.dtype, progress=_load_progress(ckpt, startup), routed_experts=cfg.ep is None,
                           device=cfg.device, cpu_weights=cfg.cpu_weights, fp8_weights=cfg.fp8_weights,
                           mtp=cfg.drafts)
        if model.device.type == "cpu":  # build the decode kernels now, not on the first request
            startup.update("building CPU kernels", force=True)
            cpu_kernels()
        self.model = model
        self.ep = self._start_ep(cfg.ep) if cfg.ep is not None else None
        # Compile and tune the Triton kernels before serving (on a GPU; ``warmup`` says otherwise);
        # after the expert-parallel group forms, so the rounds warm the shards' kernels too.
        warmup = model.device.type == "cuda" if cfg.warmup is None else cfg.warmup
        if warmup:
            startup.update("warming up", force=True)
            model.warmup(cfg.engine.max_prefill_tokens)
        return model

    def _prompt_cache(self, cfg: ReplicaConfig, namespace_id: str):
        """Every node's units through this node's agent, this replica's own store, or none."""
        if self._agents is not None:
            return self._cluster_cache(self._agents)
        if cfg.enable_cache:
            return _own_store(cfg.store, Path(cfg.store.cache_dir) / namespace_id)
        return None

    def _cluster_cache(self, agents: AgentSection) -> ClusterCache:
        """The engine's view of every node's units, through this node's agent (started on every
        node that lacks one; ``_upkeep`` repeats that now and then for nodes added later)."""
        self.node_id = ray.get_runtime_context().get_node_id()
        ensure_cache_agents(agents)
        token, tls = agent_token(agents), tls_files(agents)
        mine = client_certificate(agents, tls)
        name = f"replica-{self.node_id[:12]}"
        client_for = ClientPool(lambda addr: AgentClient(addr, token, tls["ca"], timeout_s=agents.fetch_timeout_s,
                                                         name=name, client_certificate=mine))

        # the widest KV a pool of this model keeps (the MTP layers' latents too, when it drafts)
        sizes = kv_sizes(self.model.cfg, torch.float32, draft_layers=len(getattr(self.model, "mtp", ())))
        largest = max(sizes.unit_bytes, sizes.resume_bytes) + UNIT_HEADER_SLACK
        return ClusterCache(self.node_id, NodeAgentClient(self.node_id, client_for), agents.directory.open(),
                            client_for, secret=self._secret, max_unit_bytes=largest)

    def _start_ep(self, ep: EPSection) -> EPGroup:
        dtype = self.model.dtype
        group = EPGroup(ep.control, self.replica_id, self.model.cfg.hidden_size, dtype, timeout_s=ep.timeout_s,
                        wire=Wire.named(ep.wire, dtype), device=self.model.device, backend=ep.backend)
        self.model.set_expert_executor(group.start())
        return group

    def ep_stats(self) -> dict:
        """This replica's expert-parallel view: the placement it serves (``version``,
        ``phy2log``), its measured load and rounds, and its group's re-forms and switches."""
        if self.ep is None:
            return {}
        ex = self.ep.executor
        return {**self.ep.stats, **ex.stats, "replica_id": self.replica_id, "version": ex.version,
                "phy2log": ex.placement.phy2log.tolist(), "load": ex.load.tolist(), "num_shards": ex.placement.num_shards}

    # -- the engine thread ---------------------------------------------------------------
    def _tidal_loop(self) -> None:
        """Report to the cluster's ``TidalState`` twice a second and follow its node's role."""
        from actors.tidal import tidal_state

        node = ray.get_runtime_context().get_node_id()
        try:
            actor_name = ray.get_runtime_context().get_actor_name()
            state = tidal_state()
        except Exception:  # noqa: BLE001 - not in a named actor / no cluster: no day/night
            return
        while not self._stop:
            try:
                role = ray.get(state.report.remote(node, {
                    "actor_name": actor_name, "draining": self.replica.role != "serving",
                    "running": len(self.engine.running) + len(self.engine.waiting),
                    "stats": self.stats(gpus=False)}), timeout=10)
            except Exception as e:  # noqa: BLE001 - the state actor restarts; keep serving
                log.warning("day/night state unreachable (%s); serving on as %s", e, self.replica.role)
                time.sleep(1.0)
                try:  # a state actor that died is made again on the next look-up
                    state = tidal_state()
                except Exception:  # noqa: BLE001 - no cluster to ask now: the next round tries again
                    pass
                continue
            if role == "migrate" and self.replica.role != "migrate":
                self.loop.fail_all(RequestMigrated("this replica's node is being lent to training; continue elsewhere"))
            self.replica.role = role
            time.sleep(0.5)

    def _ensure_agents(self) -> None:
        try:
            ensure_cache_agents(self._agents)
        except Exception:  # noqa: BLE001 - retried at the next check
            log.exception("could not ensure a cache agent on every node")

    def _upkeep(self) -> None:
        """On the engine loop's thread, between steps: now and then a cache agent on every node."""
        now = time.monotonic()
        if self._agents is not None and now - self._last_agents > self._agents.check_s:
            self._last_agents = now
            threading.Thread(target=self._ensure_agents, daemon=True).start()

    # -- the deployment's methods --------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput | object]:
        """Stream the outputs of ``req`` (one without a ``request_id`` is given one). P/D: a
        ``handoff`` request's last output carries ``handoff`` and is followed by the prompt's KV
        tensor; a ``prefilled`` one holds that item's reference (``actors/pd_handoff.py``)."""
        if not isinstance(req, GenerationRequest):
            raise TypeError(f"generate takes a cluster.request.GenerationRequest, got {type(req).__name__}")
        if not req.request_id:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        req = await pd_handoff.resolve(req)
        async with contextlib.aclosing(self.replica.generate(req)) as stream:  # a client gone aborts now
            async for item in stream:
                yield self._outbox().put(item.kv) if isinstance(item, PromptKV) else _for_caller(item)

    def _outbox(self) -> KVOutbox:
        """Where this replica's handed-off prompts' KV waits for the decode replicas (made at the
        first handoff; sealed when the cluster has a cache secret; at most a KV pool's bytes)."""
        if self._kv_outbox is None:
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self._kv_outbox = KVOutbox(host, seal=bool(self._secret), max_bytes=self.engine.kv.pool.nbytes())
        return self._kv_outbox

    def unit_keys(self, prompt_ids: list[int] | None = None, tenant: str = "", text: str | None = None) -> list[str]:
        """The prompt's cache unit keys (hex), as the directory knows them."""
        return self.replica.unit_keys(self.replica.prompt_ids(prompt_ids, text), tenant)

    def explain(self, prompt_ids: list[int] | None = None, tenant: str = "", text: str | None = None) -> dict:
        """What the directory answers for a prompt now (``tide cache explain``: ``Replica.explain``)."""
        return self.replica.explain(self.replica.prompt_ids(prompt_ids, text), tenant)

    def record_routing_stats(self) -> dict:
        """What the request routers score this replica by (Ray Serve polls it:
        ``cluster.routing_stats.RoutingStats`` as a dict)."""
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else self.node_id
        return self.replica.routing_stats(node).to_dict()

    def kv_capacity(self) -> dict:
        return self.replica.kv_capacity()

    def stats(self, gpus: bool = True) -> dict:
        """Engine counters, queue, cache per tier; the node's GPUs (``gpus``, an NVML read)."""
        out = {**self.replica.stats(), "replica_id": self.replica_id, "cpu_kernels": kernel_state()}
        if self._kv_outbox is not None:
            out["kv_outbox"] = {**self._kv_outbox.counters, "held": self._kv_outbox.held()}
        if gpus:
            out["gpus"] = gpu_telemetry()
        return out

    async def ready(self) -> bool:
        """The ingress's ``/health`` asks: this replica serves (its engine thread runs)."""
        return self.loop.alive

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("engine thread died")

    def __del__(self) -> None:
        """Serve calls it when it stops the replica: leave the expert-parallel group's control
        and the day/night state, which would otherwise wait for this replica until it times out."""
        self._stop = True
        if getattr(self, "loop", None) is not None:
            self.loop.stop()
        if getattr(self, "ep", None) is not None:
            self.ep.stop()
        if getattr(self, "_kv_outbox", None) is not None:
            self._kv_outbox.close()
        name = _actor_name()
        if name and ray.is_initialized():
            try:
                from actors.tidal import NAMESPACE, STATE_NAME

                ray.get_actor(STATE_NAME, namespace=NAMESPACE).forget.remote(name)
            except Exception:  # noqa: BLE001 - shutting down (or no day/night state); the report goes stale
                pass


