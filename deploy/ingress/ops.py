"""The ingress's operational routes' work: ``/health`` (every pool answers), ``/metrics`` (the
ingress's series plus what the replicas, the day/night state, the expert placement and the
nodes' caches report), ``/tokenize`` and ``/detokenize`` (as vLLM has them)."""

from __future__ import annotations

import asyncio
import logging

from deploy.errors import APIError, error_body
from deploy.ingress.dispatch import RETRY_AFTER_S
from deploy.ingress.service import Ingress
from deploy.protocol import ChatMessage

__all__ = ["health", "metrics_text", "tokenized"]

log = logging.getLogger(__name__)


async def health(ingress: Ingress) -> tuple[int, dict, dict]:
    """(status, body, headers): 200 once a replica of every pool answers; 503 while none of
    one can serve (starting, every replica gone)."""
    pools = [("LLMServer", ingress.pool)] + ([("LLMDecode", ingress.decode)] if ingress.decode is not None else [])
    for name, pool in pools:
        if not await pool.ready():
            return 503, error_body(f"no {name} replica can serve right now", "server_error", None,
                                   "service_unavailable"), {"Retry-After": str(RETRY_AFTER_S)}
    return 200, {"status": "ok"}, {}


def tokenized(ingress: Ingress, prompt: str | None, messages: list[ChatMessage] | None, add_special_tokens: bool,
              add_generation_prompt: bool) -> dict:
    """Token ids of a prompt or of chat messages, as the completion routes would make them (on a
    prep thread)."""
    if (prompt is None) == (messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if messages is not None:
        try:
            ids = ingress.tokenizer.apply_chat_template([m.template_dict() for m in messages], None,
                                                        generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    else:
        ids = ingress.prepare.encode(prompt, bos=add_special_tokens)
    return {"count": len(ids), "max_model_len": ingress.context_len, "tokens": ids}


async def metrics_text(ingress: Ingress, batch_runner=None) -> str:
    """The Prometheus text of ``/metrics`` (``batch_runner``: the batch lines this ingress runs);
    a source that does not answer leaves its series out."""
    m = ingress.metrics
    if batch_runner is not None:
        m.batch(batch_runner.queued, batch_runner.running, batch_runner.done)
    try:
        await _tidal(m)
    except Exception as e:  # noqa: BLE001 - no day/night state: the other series still serve
        log.warning("replica reports unavailable for /metrics: %s", e)
    if ingress.cfg.expert_parallel:
        try:
            await _placement(m)
        except Exception as e:  # noqa: BLE001 - the control restarts: the other series still serve
            log.warning("expert placement unavailable for /metrics: %s", e)
    try:  # the nodes' cache tiers and GPUs, through one replica
        await _nodes(m, await ingress.pool.stats())
    except Exception as e:  # noqa: BLE001 - metrics still serve the ingress's own series
        log.warning("replica stats unavailable for /metrics: %s", e)
    return m.render().decode()


async def _tidal(m) -> None:
    import ray

    from actors.tidal import tidal_state

    state = tidal_state()
    m.replicas(await state.replica_reports.remote())
    alive = await asyncio.to_thread(lambda: [n["NodeID"] for n in ray.nodes() if n["Alive"]])
    m.node_roles(alive, await state.roles.remote())
    m.tidal(await state.nights.remote(), await state.job.remote())


async def _placement(m) -> None:
    from deploy.ep_admin import find_ep_control_info, placement_imbalance

    found = await asyncio.to_thread(find_ep_control_info, 5.0)
    if found is not None:
        control, info = found
        load = await control.load.remote()
        m.expert_placement(info, await asyncio.to_thread(placement_imbalance, info, load))


async def _nodes(m, stats: dict) -> None:
    """Each node's cache tiers (from every node's cache agent, which owns the node's units, or
    from the replica's own store when the app runs without agents) and the replica's GPUs."""
    if "ssd_units" in stats["cache"]:  # a per-replica store (cache_agents off)
        caches = {stats["node_id"]: stats["cache"]}
    else:
        from actors.cache_agent import agents_stats

        caches = await asyncio.to_thread(agents_stats, 10.0)
    for node, cache in caches.items():
        for tier in ("ssd", "ram"):
            m.tier_bytes(node[:12], tier).set(cache.get(f"{tier}_bytes", 0))
            m.tier_units(node[:12], tier).set(cache.get(f"{tier}_units", 0))
    gpus = stats.get("gpus", {}).get("gpus", [])
    m.gpus.set(len(gpus))
    for g in gpus:
        idx = str(g["index"])
        m.gpu_memory_used(idx).set(g["memory_used_bytes"])
        m.gpu_memory_total(idx).set(g["memory_total_bytes"])
        m.gpu_utilization(idx).set(g["utilization"])
        m.gpu_temperature(idx).set(g["temperature_c"])
