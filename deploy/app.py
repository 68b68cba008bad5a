"""Builds the Ray Serve application: the OpenAI ingress in front of ``LLMServer`` replicas
(and, with ``decode_replicas``, a decode pool ``LLMDecode`` that the prefill replicas hand off to).

``build_app(args)`` is the ``import_path`` target of ``deploy/serve_config.yaml`` (``serve run`` /
``serve deploy``) and of KubeRay's ``serveConfigV2``; ``tide up`` calls it too. Deployment options
are applied here, not on the classes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.llm_server import LLMServer
from actors.replica_config import (
    AgentSection,
    DirectorySection,
    EPSection,
    ReplicaConfig,
)
from cachedir.hashing import read_secret
from deploy.app_args import AppArgs, gpus_per_actor
from deploy.ep_admin import ep_control_name
from deploy.ingress.config import IngressConfig
from deploy.limits import KeyGrant, Limits
from deploy.openai_api import OpenAIIngress
from model.config import check_checkpoint_dir

__all__ = ["EXPERT_SHARD_NAME", "AppArgs", "build_app", "expert_shard_nodes", "recorded_app_args"]


def key_tenant(key: str) -> str:
    """The tenant of a key configured without one: a hash of the whole key (keys that share a
    prefix, as ``sk-proj-...`` keys do, must not share a cache)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


ALLOW_NO_KEYS = "TIDE_ALLOW_NO_API_KEYS"  # "1": an empty TIDE_API_KEYS serves without keys


def api_keys_from_env() -> dict[str, str] | None:
    """The keys of ``TIDE_API_KEYS`` (None where it is not set). Set but empty, as from an empty
    Kubernetes Secret, it is an error: the API would serve open without anyone deciding so
    (``TIDE_ALLOW_NO_API_KEYS=1`` decides so)."""
    raw = os.environ.get("TIDE_API_KEYS")
    if raw is None:
        return None
    if not raw.strip():
        if os.environ.get(ALLOW_NO_KEYS) == "1":
            return None
        raise ValueError(f"TIDE_API_KEYS is set but empty: the API would accept every request; give keys "
                         f"(KEY:TENANT,...), unset it, or set {ALLOW_NO_KEYS}=1 to serve without keys")
    keys = {}
    for item in raw.split(","):
        key, _, grant = item.partition(":")
        if not key:
            raise ValueError("TIDE_API_KEYS entries are KEY:TENANT[:MODEL+...], comma-separated")
        keys[key] = grant or key_tenant(key)
        KeyGrant.parse(keys[key])
    return keys


def _secret(env_name: str | None, field: str) -> str | None:
    """The value of the env var a ``*_env`` field names (secrets never sit in a Serve config)."""
    if not env_name:
        return None
    if env_name not in os.environ:
        raise ValueError(f"{field} names {env_name!r}, which is not set")
    return os.environ[env_name]


EXPERT_SHARD_NAME = "tideserve-expert-shard-{}"  # detached, in the "tideserve" namespace
# How often a stopping replica checks that its requests have finished (Serve's default, 2 s, is
# also what every idle replica waits before it stops: tide down, a night's redeploy, scale-in)
DRAIN_POLL_S = 0.25


def expert_shard_nodes(num_nodes: int, num_shards: int) -> int:
    """The node count EPLB plans for: its hierarchical policy wants equal shards per node."""
    nodes = max(1, min(num_nodes, num_shards))
    return nodes if num_shards % nodes == 0 else 1


def _agent_token_source(a: AppArgs) -> dict[str, str]:  # AgentSection's token fields
    """Where agents and replicas find the agent token: the configured file or env var (checked
    here, so a bad one fails the deploy, not every replica). Without one the deploy fails:
    agents never serve unauthenticated, and a token the app made up would have to travel
    through Ray (its KV or the actors' arguments), which every Ray job can read."""
    token_file = a.agent_token_file or os.environ.get("TIDE_AGENT_TOKEN_FILE") or None
    if a.agent_token_env:
        _secret(a.agent_token_env, "agent_token_env")
        return {"token_env": a.agent_token_env}
    if token_file:
        read_secret(token_file, "agent token")
        return {"token_file": token_file}
    raise ValueError("the cache agents need a token, read on each node: set agent_token_file (a 0600 file on "
                     "every node), agent_token_env, or $TIDE_AGENT_TOKEN_FILE (tide up makes "
                     "$TIDE_HOME/run/agent.token)")


def shard_actor_options(device: str) -> dict[str, Any]:
    """Ray resources of one expert-shard actor: no CPU (it waits in collectives between rounds;
    its gloo threads are not Ray tasks), and its GPU under ``device="cuda"``."""
    return {"num_cpus": 0, "num_gpus": gpus_per_actor(device)}


def _expert_shards(checkpoint: str, a: AppArgs) -> EPSection:
    """Detached expert-shard actors dealt round-robin over the alive nodes (named, so a redeploy
    reuses them; Ray restarts one that dies on its node) and the ``EPControl`` whose placement
    every replica follows. EPLB plans for equal shards per node, so placement is explicit and hard:
    Ray's SPREAD and soft node affinity both stacked zero-CPU actors on one node. A shard whose
    node is gone is dead; the next deploy creates it again on an alive node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.ep_control import ep_control_actor
    from actors.ep_group import expert_shard_actor
    from model.checkpoint import load_config
    from model.weights_id import stored_mtp_layers, tensor_names

    experts = load_config(checkpoint).n_routed_experts
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]) if ray.is_initialized() else []
    shards = [
        expert_shard_actor(
            name=EXPERT_SHARD_NAME.format(i), namespace="tideserve", lifetime="detached", get_if_exists=True,
            **shard_actor_options(a.device),
            scheduling_strategy=NodeAffinitySchedulingStrategy(alive[i % len(alive)], soft=False) if alive else "SPREAD",
        ).remote(a.dtype, a.device)
        for i in range(a.expert_shards)
    ]
    nodes = expert_shard_nodes(max(1, len(alive)), a.expert_shards)
    slots = a.expert_slots or experts + (-experts) % a.expert_shards + a.expert_shards
    name = ep_control_name(checkpoint)
    drafts = stored_mtp_layers(load_config(checkpoint), tensor_names(checkpoint)) if a.drafts_per_step else 0
    control = ep_control_actor(name=name, namespace="tideserve", lifetime="detached", get_if_exists=True,
                               num_cpus=0).remote(checkpoint, shards, slots, nodes, rebalance_s=a.expert_rebalance_s,
                                                  name=name, draft_layers=drafts)
    return EPSection(control, wire=a.ep_wire, backend=a.ep_backend)


_APP_ARGS_KEY = b"tideserve/app_args"


def _record_app_args(a: AppArgs) -> None:
    """Keep the app's args in the cluster, so admin commands on a cluster ``tide up`` did not
    start (``--address``) can read them and redeploy it with other replica counts. API keys are
    secrets and stay out (Ray's KV is readable by every job): only that there are some."""
    import ray

    if ray.is_initialized():
        from ray.experimental.internal_kv import _internal_kv_put

        record = {**a.model_dump(exclude={"api_keys"}), "api_keys": None, "has_api_keys": bool(a.api_keys)}
        _internal_kv_put(_APP_ARGS_KEY, json.dumps(record).encode(), overwrite=True)


def recorded_app_args() -> dict[str, Any] | None:
    """What the last ``build_app`` on this cluster was given (None when nothing was recorded)."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_APP_ARGS_KEY)
    return json.loads(raw) if raw else None


def build_app(args: dict[str, Any] | AppArgs | None = None):
    a = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    from model.default import cache_root

    _record_app_args(a)
    server_cfg = replica_config(a)
    server, decode = _model_deployments(a, server_cfg)
    ingress_cfg = IngressConfig(
        server_cfg.identity, a.model_name, Limits(**(a.limits or {})), a.api_keys or api_keys_from_env(),
        # the ingress plans each request's prefix for the cache-aware router only
        server_cfg.directory if a.router == "cache-aware" else DirectorySection(),
        tuple(a.public_paths), bool(a.expert_shards), a.structured_whitespace,
        server_cfg.directory, a.files_dir or str(cache_root() / "files"))
    ingress_options: dict[str, Any] = {"num_cpus": 0}
    if a.ingress_on_head:
        ingress_options["resources"] = {"node:__internal_head__": 0.001}
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options=ingress_options,
                               max_ongoing_requests=256, graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    return _versioned(ingress, ingress_cfg, ingress_options, decode is not None).bind(server, ingress_cfg, decode)


def replica_config(a: AppArgs) -> ReplicaConfig:
    """The replicas' config; a bad checkpoint or secret fails here, not in every replica.
    Secrets travel by name (an env var, a file) and are read on each node: Serve configs and
    actor arguments sit in Ray's GCS, which every Ray job can read."""
    from model.default import cache_root, default_checkpoint

    checkpoint = a.checkpoint or str(default_checkpoint())
    check_checkpoint_dir(checkpoint)
    secret_file = a.cache_secret_file or os.environ.get("TIDE_CACHE_SECRET_FILE") or None
    read_secret(secret_file)
    _secret(a.directory_password_env, "directory_password_env")
    directory = DirectorySection(a.directory_url, a.directory_namespace, a.directory_password_env or None,
                                 ca_file=a.directory_tls_ca_file)
    store = a.store_section(str(cache_root() / "cache"))
    agents = None
    if a.cache_agents and a.enable_cache:
        agents = AgentSection(store, directory, **_agent_token_source(a), tls_cert_file=a.agent_tls_cert_file,
                              tls_key_file=a.agent_tls_key_file, tls_ca_file=a.agent_tls_ca_file,
                              tls_mutual=a.agent_tls_mutual, replicas=a.cache_replicas,
                              warm_bytes=a.night_keep_bytes, warm_s=a.night_keep_s)
    return ReplicaConfig(
        checkpoint, store, a.dtype, a.device, a.cpu_weights, a.fp8_weights, cpu_threads=a.cpu_threads,
        engine=a.engine_config(), stream_batching_interval_ms=a.stream_batching_interval_ms,
        enable_cache=a.enable_cache, directory=directory, agents=agents,
        ep=_expert_shards(checkpoint, a) if a.expert_shards else None,
        usage_dir=a.usage_dir or str(cache_root() / "usage"), cache_secret_file=secret_file)


ROUTERS = {"cache-aware": "deploy.prefill_router:CacheAwareRouter",
           "round-robin": "deploy.prefill_router:RoundRobinRouter",
           "prefix-affinity": "deploy.prefill_router:PrefixAffinityRouter"}


def _routed(router_class: str, a: AppArgs) -> RequestRouterConfig:
    kwargs = {"affinity_tokens": a.affinity_tokens, "affinity_queue_ratio": a.affinity_queue_ratio,
              "affinity_queue_gap": a.affinity_queue_gap} if router_class == ROUTERS["prefix-affinity"] else {}
    return RequestRouterConfig(request_router_class=router_class, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5)


def _model_deployments(a: AppArgs, server_cfg: ReplicaConfig):
    """The bound ``LLMServer`` deployment and, under P/D, the decode pool ``LLMDecode`` (else None)."""
    router = ROUTERS.get(a.router)
    options: dict[str, Any] = {"request_router_config": _routed(router, a)} if router else {}
    replica_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": a.replica_cpus, "num_gpus": gpus_per_actor(a.device)},
        "max_ongoing_requests": 64, "health_check_period_s": 10, "max_replicas_per_node": a.max_replicas_per_node,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }
    server_dep = serve.deployment(LLMServer, name="LLMServer", num_replicas=a.replicas, **replica_options, **options)
    server = _versioned(server_dep, server_cfg, replica_options, router).bind(server_cfg)
    if not a.decode_replicas:
        return server, None
    decode_dep = serve.deployment(LLMServer, name="LLMDecode", num_replicas=a.decode_replicas, **replica_options,
                                  request_router_config=_routed("deploy.decode_router:DecodeRouter", a))
    return server, _versioned(decode_dep, server_cfg, replica_options, "decode").bind(server_cfg)


def deployment_version(*parts: Any) -> str:
    """A version that changes only with what a deployment's replicas are built from. Without
    one, every ``serve.run`` gets a random version and Serve replaces every replica: a day/night
    redeploy that only changes replica counts would restart the whole app, the ingress too, and
    fail the requests in flight there. Actor handles count by actor id."""
    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o):  # a config section: its fields, by name
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        actor_id = getattr(o, "_actor_id", None)
        return actor_id.hex() if actor_id is not None else repr(o)

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=default).encode()).hexdigest()[:16]


def _versioned(deployment, *parts: Any):
    # Serve's Python API takes no version any more (the decorator refuses one), but ``serve.run``
    # still uses the deployment's ``_version`` when it is set.
    if hasattr(deployment, "_version"):
        deployment._version = deployment_version(*parts)
    return deployment
