"""The Prometheus series the ingress serves at ``/metrics``: ``tide:*``, each with a
``model_name`` label, named after the vLLM series that dashboards, autoscalers and the Gateway
API inference scheduler already read (``vllm:`` -> ``tide:`` where the meaning is the same).

| tide | vLLM | what |
| --- | --- | --- |
| ``tide:num_requests_running{deployment,replica,node}`` | ``vllm:num_requests_running`` | sequences in a replica's batch |
| ``tide:num_requests_waiting{deployment,replica,node}`` | ``vllm:num_requests_waiting`` | sequences queued for prefill |
| ``tide:kv_cache_usage_perc{deployment,replica,node}`` | ``vllm:kv_cache_usage_perc`` | KV pages in use (0..1) |
| ``tide:prompt_tokens_total{source}`` | ``vllm:prompt_tokens_total`` (the sum over sources) | prompt tokens by where their KV came from |
| ``tide:prompt_cache_listed_tokens_total``, ``tide:prompt_cache_planned_tokens_total`` | (none) | prompt tokens the directory listed live holders for / routing chose to load (beside ``prompt_tokens_total``'s delivered sources) |
| ``tide:prompt_cache_misses_total{reason}`` | (none) | computed tokens of whole units that could have been cached: ``stale`` (the plan loaded them, the load did not deliver), ``declined`` (the directory listed holders, the router did not load them), ``evicted`` (no live node listed; the first of them its holders dropped), ``unseen`` (no live node listed, never registered or long ago) |
| ``tide:generation_tokens_total`` | ``vllm:generation_tokens_total`` | generated tokens |
| ``tide:request_success_total{status}`` | ``vllm:request_success_total`` | finished requests, ok or error |
| ``tide:time_to_first_token_seconds`` | ``vllm:time_to_first_token_seconds`` | histogram, at the ingress |
| ``tide:inter_token_latency_seconds`` | ``vllm:inter_token_latency_seconds`` | histogram, at the ingress |
| ``tide:e2e_request_latency_seconds`` | ``vllm:e2e_request_latency_seconds`` | histogram, at the ingress |
| ``tide:request_queue_time_seconds`` | ``vllm:request_queue_time_seconds`` | histogram: arrival at a replica to its first step |
| ``tide:requests_in_flight`` | (none) | requests this ingress is streaming |
| ``tide:batch_lines{state}`` | (none) | lines of the batches this ingress runs: ``queued``, ``running`` |
| ``tide:batch_lines_done_total{status}`` | (none) | batch lines this ingress finished: ``completed``, ``failed`` |
| ``tide:nodes{role}`` | (none) | alive Ray nodes by day/night role: serving, draining, migrate, lent |
| ``tide:nights``, ``tide:nights_migrated``, ``tide:night_drain_seconds`` | (none) | nights so far, those whose drain passed its deadline (requests continued on other replicas), the last drain's duration |
| ``tide:training_job_active`` | (none) | 1 while a night's training job runs on the lent nodes |
| ``tide:ep_placement_version``, ``tide:ep_shards`` | (none) | expert parallelism: the placement served, over how many shards |
| ``tide:ep_rebalances``, ``tide:ep_moved_slots`` | (none) | EPLB rebalances and expert slots whose weights moved, since the control started |
| ``tide:ep_imbalance`` | (none) | max over mean shard load of the placement served, on the load the replicas measured |

The per-replica series come from the replicas' heartbeats (``actors.tidal.TidalState``), one
series per replica, so a multi-replica app reports each replica rather than whichever one a
scrape reached. tideserve's own: ``tide:requests_continued_total``, ``tide:pd_handoffs_total``,
``tide:cache_bytes`` / ``tide:cache_units{node,tier}``, ``tide:gpus`` and ``tide:gpu_*{gpu}``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["IngressMetrics"]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _Family:
    """A labelled metric with ``model_name`` filled in: ``family(*other_labels)`` is the child."""

    def __init__(self, metric: Any, model: str) -> None:
        self.metric, self.model = metric, model

    def __call__(self, *labels: str) -> Any:
        return self.metric.labels(self.model, *labels)

    def clear(self) -> None:
        self.metric.clear()


class IngressMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def family(kind, name: str, doc: str, labels: list[str], **kw) -> _Family:
            return _Family(kind(name, doc, m + labels, registry=r, **kw), model_name)

        def one(kind, name: str, doc: str, **kw):
            return kind(name, doc, m, registry=r, **kw).labels(model_name)

        replica = ["deployment", "replica", "node"]
        self.num_running = family(Gauge, "tide:num_requests_running", "sequences in a replica's decode batch", replica)
        self.num_waiting = family(Gauge, "tide:num_requests_waiting", "sequences a replica has queued for prefill",
                                  replica)
        self.kv_usage = family(Gauge, "tide:kv_cache_usage_perc", "fraction of a replica's KV pages in use", replica)
        self.prompt_tokens = family(Counter, "tide:prompt_tokens", "prompt tokens by where their KV came from",
                                    ["source"])
        self.cache_misses = family(Counter, "tide:prompt_cache_misses",
                                   "computed prompt tokens of whole units, by why they were not loaded", ["reason"])
        self.listed_tokens = one(Counter, "tide:prompt_cache_listed_tokens",
                                 "prompt tokens the directory listed live holders for")
        self.planned_tokens = one(Counter, "tide:prompt_cache_planned_tokens", "prompt tokens routing chose to load")
        self.generation_tokens = one(Counter, "tide:generation_tokens", "generated tokens")
        self.requests = family(Counter, "tide:request_success", "finished requests", ["status"])
        self.continued = one(Counter, "tide:requests_continued", "requests moved to another replica mid-stream")
        self.handoffs = one(Counter, "tide:pd_handoffs", "requests a prefill replica handed to the decode pool (P/D)")
        self.responses_not_stored = one(Counter, "tide:responses_not_stored",
                                        "Responses asked to be stored that were not (over the size limit, or the "
                                        "store failed)")
        self.in_flight = one(Gauge, "tide:requests_in_flight", "requests this ingress is streaming")
        self.batch_lines = family(Gauge, "tide:batch_lines", "lines of the batches this ingress runs", ["state"])
        self.batch_done = family(Counter, "tide:batch_lines_done", "batch lines this ingress finished", ["status"])
        self._batch_done_seen = {"completed": 0, "failed": 0}
        self.ttft = one(Histogram, "tide:time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS)
        self.itl = one(Histogram, "tide:inter_token_latency_seconds", "time between output tokens",
                       buckets=TOKEN_BUCKETS)
        self.e2e = one(Histogram, "tide:e2e_request_latency_seconds", "request latency, arrival to last token",
                       buckets=E2E_BUCKETS)
        self.queue_time = one(Histogram, "tide:request_queue_time_seconds",
                              "arrival at a replica to the first step that takes it up", buckets=LATENCY_BUCKETS)
        self.tier_bytes = family(Gauge, "tide:cache_bytes", "prompt-cache bytes a node holds per tier", ["node", "tier"])
        self.tier_units = family(Gauge, "tide:cache_units", "prompt-cache units a node holds per tier", ["node", "tier"])
        self.nodes = family(Gauge, "tide:nodes", "alive Ray nodes by day/night role", ["role"])
        self.nights = one(Gauge, "tide:nights", "nights (nodes lent to training) since the cluster started")
        self.nights_migrated = one(Gauge, "tide:nights_migrated",
                                   "nights whose drain passed its deadline: requests continued on other replicas")
        self.drain_s = one(Gauge, "tide:night_drain_seconds", "how long the last night's drain took")
        self.training = one(Gauge, "tide:training_job_active", "1 while a night's training job runs")
        self.ep_version = one(Gauge, "tide:ep_placement_version", "the expert placement the replicas serve")
        self.ep_shards = one(Gauge, "tide:ep_shards", "expert shards the placement spreads the experts over")
        self.ep_rebalances = one(Gauge, "tide:ep_rebalances", "EPLB rebalances since the control started")
        self.ep_moved_slots = one(Gauge, "tide:ep_moved_slots",
                                  "expert slots whose weights moved in rebalances since the control started")
        self.ep_imbalance = one(Gauge, "tide:ep_imbalance",
                                "max over mean shard load of the placement served, on the load measured")
        # speculative decoding (MTP drafts), vLLM's names: every replica's counts summed
        self.spec_drafts = one(Counter, "tide:spec_decode_num_drafts", "decode rows that verified drafts")
        self.spec_draft_tokens = one(Counter, "tide:spec_decode_num_draft_tokens", "draft tokens verified")
        self.spec_accepted = one(Counter, "tide:spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_accepted_pos = family(Counter, "tide:spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted, by draft position", ["position"])
        self._spec_seen: dict[str, dict] = {}  # replica -> its last reported counts
        self.gpus = one(Gauge, "tide:gpus", "NVIDIA GPUs a replica's node reports (0: absent)")
        self.gpu_memory_used = family(Gauge, "tide:gpu_memory_used_bytes", "GPU memory used", ["gpu"])
        self.gpu_memory_total = family(Gauge, "tide:gpu_memory_total_bytes", "GPU memory", ["gpu"])
        self.gpu_utilization = family(Gauge, "tide:gpu_utilization", "GPU busy fraction", ["gpu"])
        self.gpu_temperature = family(Gauge, "tide:gpu_temperature_celsius", "GPU temperature", ["gpu"])

    def count_prompt(self, prompt_tokens: int, sources) -> None:
        """A finished request's prompt tokens by source (``cluster.request.TokenSources``), what
        the directory listed and routing planned of them, and its cache misses by reason."""
        for source in ("compute", "ram", "ssd", "remote"):
            self.prompt_tokens(source).inc(getattr(sources, source))
        acc = sources.accounting(prompt_tokens)
        self.listed_tokens.inc(acc["listed_tokens"])
        self.planned_tokens.inc(acc["planned_tokens"])
        for reason, n in acc["missed_tokens"].items():
            self.cache_misses(reason).inc(n)

    def replicas(self, reports: dict[str, dict]) -> None:
        """One series per replica that reported lately (``TidalState.replica_reports``: actor
        name -> heartbeat with its ``stats``); a replica that stopped reporting has none."""
        for f in (self.num_running, self.num_waiting, self.kv_usage):
            f.clear()
        for name, report in reports.items():
            stats = report.get("stats") or {}
            labels = (_deployment(name), name.rsplit("#", 1)[-1], str(report.get("node_id", ""))[:12])
            self.num_running(*labels).set(stats.get("running", 0))
            self.num_waiting(*labels).set(stats.get("waiting", 0))
            if "kv_usage" in stats:
                self.kv_usage(*labels).set(stats["kv_usage"])
            if "spec_decode" in stats:
                self._count_spec(name, stats["spec_decode"])

    def _count_spec(self, replica: str, spec: dict) -> None:
        """A replica's speculative decoding counts (``SpecStats.as_dict``) into the counters: what
        grew since its last report (all of them after it restarted)."""
        seen = self._spec_seen.get(replica, {"draft_tokens": [], "accepted_tokens": []})
        drafted, accepted = spec["draft_tokens"], spec["accepted_tokens"]
        if any(n < m for n, m in zip(drafted, seen["draft_tokens"], strict=False)):
            seen = {"draft_tokens": [], "accepted_tokens": []}  # a new engine: it counts from 0
        grew_d = [n - (seen["draft_tokens"][j] if j < len(seen["draft_tokens"]) else 0) for j, n in enumerate(drafted)]
        grew_a = [n - (seen["accepted_tokens"][j] if j < len(seen["accepted_tokens"]) else 0)
                  for j, n in enumerate(accepted)]
        if grew_d:
            self.spec_drafts.inc(grew_d[0])
        self.spec_draft_tokens.inc(sum(grew_d))
        self.spec_accepted.inc(sum(grew_a))
        for j, n in enumerate(grew_a):
            self.spec_accepted_pos(str(j)).inc(n)
        self._spec_seen[replica] = {"draft_tokens": list(drafted), "accepted_tokens": list(accepted)}

    def node_roles(self, alive: list[str], roles: dict[str, str]) -> None:
        """``alive`` node ids; ``roles``: ``TidalState.roles`` (a node without one serves)."""
        from actors.tidal import ROLES

        counts = dict.fromkeys(ROLES, 0)
        for node in alive:
            counts[roles.get(node, "serving")] += 1
        for role, n in counts.items():
            self.nodes(role).set(n)

    def tidal(self, nights: dict, job_id: str | None) -> None:
        """``TidalState.nights`` and ``TidalState.job``."""
        self.nights.set(nights["nights"])
        self.nights_migrated.set(nights["migrated"])
        self.drain_s.set(nights["last_drain_s"])
        self.training.set(1 if job_id else 0)

    def expert_placement(self, info: dict, imbalance: float | None = None) -> None:
        """``actors.ep_control.EPControl.info`` of the app's control, and its placement's
        imbalance on the measured load (``deploy.ep_admin.placement_imbalance``)."""
        if info.get("version") is not None:
            self.ep_version.set(info["version"])
        if imbalance is not None:
            self.ep_imbalance.set(imbalance)
        self.ep_shards.set(info.get("num_shards", 0))
        self.ep_rebalances.set(info.get("rebalances", 0))
        self.ep_moved_slots.set(info.get("moved_slots", 0))

    def batch(self, queued: int, running: int, done: dict[str, int]) -> None:
        """The batch runner's lines (``deploy.ingress.batch_runner``): in its jobs, and done so far."""
        self.batch_lines("queued").set(queued)
        self.batch_lines("running").set(running)
        for status, n in done.items():
            self.batch_done(status).inc(n - self._batch_done_seen[status])
            self._batch_done_seen[status] = n

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _deployment(actor_name: str) -> str:
    """A Serve replica actor's deployment (``SERVE_REPLICA::app#deployment#id``)."""
    parts = actor_name.split("#")
    return parts[1] if len(parts) == 3 else actor_name
