"""``Replica``: one model replica, Ray-free. It owns the engine on its loop thread, the node's
prompt cache as the engine sees it, the per-request usage log, the directory publisher of its
own store and its measured cost model; ``actors.llm_server.LLMServer`` builds one and serves it.

A request with a prefix plan loads what the plan's holders have on this replica's node and
elsewhere, as much as the balancer's estimate says pays (``cluster.prefill_lb.load_units``,
with this replica's measured costs); the router that sent it chose this replica by the same
estimate."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from cachedir.agent.cluster_cache import ClusterCache
from cachedir.directory.base import DirectoryUnavailable
from cachedir.hashing import chain_keys, resume_key
from cachedir.node_cache import NodeCache
from cachedir.publisher import DirectoryPublisher
from cluster.daily_report import JsonlLog, UsageRecord
from cluster.engine import Engine
from cluster.engine_loop import EngineLoop, PromptKV
from cluster.memory_bound import memory_bound, resident_mb, tensor_bytes
from cluster.prefill_lb import Bandwidth, CostModel, fit_compute, load_units
from cluster.request import UNIT_TOKENS, FinishReason, GenerationRequest, RequestOutput
from cluster.routing_stats import RoutingStats

__all__ = ["Replica"]

PUBLISH_EVERY_S = 1.0  # how often the node's new units go to the directory


class Replica:
    def __init__(self, engine: Engine, node_id: str, tokenizer, *, usage_dir: str | None = None,
                 open_directory: Callable | None = None, upkeep: Callable[[], None] | None = None,
                 threads: int | None = None, stream_batching_interval_s: float = 0.0) -> None:
        """``engine``: its cache (``engine.cache``) is this node's (a ``NodeCache``) or every
        node's through the node's agent (a ``ClusterCache``). ``open_directory()``: the cache
        directory's client (None: no directory); ``upkeep``: the caller's own periodic work, on
        the loop's thread between steps (it must not block for long)."""
        self.engine, self.node_id, self.tokenizer = engine, node_id, tokenizer
        self.cache = engine.cache
        self.role = "serving"  # day/night: "draining" / "migrate" while its node is being lent
        self._open_directory = open_directory or (lambda: None)
        self._explain_directory = None
        # one usage log per replica process (``tide stats`` reads them all)
        self.usage = JsonlLog(Path(usage_dir) / f"{node_id}.jsonl") if usage_dir else None
        self.publisher = None
        directory = self._open_directory() if isinstance(self.cache, NodeCache) else None
        if directory is not None:
            self.publisher = DirectoryPublisher(directory, node_id, "", self.cache.holdings)
        self._cost = CostModel(unit_bytes=engine.kv.unit_bytes())
        # the most its configuration lets it hold (``cluster.memory_bound``), beside its RSS in stats
        self.memory_bound = memory_bound(tensor_bytes(engine.model), engine.kv.pool.nbytes(),
                                         engine.model.cfg.vocab_size, engine.cfg,
                                         self.cache.memory_bytes() if self.cache is not None else 0)
        self._bandwidth = {"local": Bandwidth(self._cost.local_bps), "remote": Bandwidth(self._cost.remote_bps)}
        self._transfer_seen = {"local": (0, 0.0), "remote": (0, 0.0)}
        self._upkeep_fn, self._last_sync = upkeep, time.monotonic()
        self.loop = EngineLoop(engine, on_output=self._record_usage, tick=self._upkeep, threads=threads,
                               stream_batching_interval_s=stream_batching_interval_s).start()

    # -- requests --------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput | PromptKV]:
        """The request's outputs (``PromptKV`` after a handoff's last output, P/D): the engine
        loop's stream, its plan's load decided here first."""
        plan = req.plan
        if plan is not None and plan.load_units is None:
            units = load_units(self.node_id, len(req.prompt_ids), plan.holders, self.cost_model())
            req = dataclasses.replace(req, plan=dataclasses.replace(plan, load_units=min(units, len(plan.holders))))
        return self.loop.stream(req)

    def _record_usage(self, o: RequestOutput) -> None:
        if o.finished and self.usage is not None and o.finish_reason != FinishReason.HANDOFF:
            self.usage.append(UsageRecord(time.time(), o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.decode_s,
                                          batch=o.background))

    def _upkeep(self) -> None:
        """Between steps: the caller's upkeep, and now and then the node's new units to the directory."""
        if self._upkeep_fn is not None:
            self._upkeep_fn()
        now = time.monotonic()
        if self.publisher is not None and now - self._last_sync > PUBLISH_EVERY_S:
            self._last_sync = now
            self.publisher.record(self.cache.drain_events())
            self.publisher.sync()  # failures are counted and retried; never raises

    # -- what the routers and operators read -----------------------------------------------
    def cost_model(self) -> CostModel:
        """The measured cost model: compute fitted on recent prefill chunks, load bandwidths."""
        token_s, attn_s = fit_compute(list(self.engine.prefill_samples), self._cost)
        return dataclasses.replace(self._cost, token_s=token_s, attn_s=attn_s,
                                   local_bps=self._bandwidth["local"].bps, remote_bps=self._bandwidth["remote"].bps)

    def routing_stats(self, node: str | None = None) -> RoutingStats:
        """What the request routers score this replica by (``node``: where it runs, if not ``node_id``)."""
        if isinstance(self.cache, ClusterCache):  # the loads since the last report
            for source, bw in self._bandwidth.items():
                nbytes, secs = self.cache.transfer[source]
                seen_b, seen_s = self._transfer_seen[source]
                bw.observe(nbytes - seen_b, secs - seen_s)
                self._transfer_seen[source] = (nbytes, secs)
        cfg = self.engine.cfg
        return RoutingStats(node or self.node_id, time.time(), self.role != "serving", tuple(self.engine.queue_state()),
                            len(self.engine.running), len(self.engine.prefill_samples), cfg.num_pages * cfg.page_size,
                            cfg.page_size, self.cost_model())

    def kv_capacity(self) -> dict:
        return {"tokens": self.engine.cfg.num_pages * self.engine.cfg.page_size, "page_size": self.engine.cfg.page_size}

    def stats(self) -> dict:
        """Engine counters, queue, KV use, the cache per tier, the directory publisher's backlog,
        speculative decoding's acceptance."""
        eng = self.engine
        out = {"node_id": self.node_id, "engine": dict(eng.stats), "running": len(eng.running),
               "waiting": len(eng.waiting), "max_num_seqs": eng.cfg.max_num_seqs, "threads": self.loop.threads_used,
               "kv_usage": 1.0 - eng.kv.pages.num_free / eng.kv.num_pages,
               "cache": self.cache.stats() if self.cache is not None else {}}
        if self.publisher is not None:
            out["directory"] = {"pending": self.publisher.pending, "failures": self.publisher.failures}
        if eng.spec.enabled:  # MTP drafts verified and accepted, per draft position
            out["spec_decode"] = eng.spec.stats.as_dict()
        out["memory"] = {**resident_mb(), "bound": self.memory_bound.to_dict()}
        return out

    def prompt_ids(self, prompt_ids: list[int] | None, text: str | None) -> list[int]:
        """``prompt_ids``, or ``text`` tokenized as the completions API does (BOS + text)."""
        if text is None:
            return prompt_ids
        bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        return bos + self.tokenizer.encode(text)

    def unit_keys(self, prompt_ids: list[int], tenant: str = "") -> list[str]:
        """The prompt's cache unit keys (hex), as the directory knows them."""
        ns = self.engine.namespace_for(tenant)
        return [k.hex() for k in chain_keys(ns.seed, prompt_ids, ns.unit_size)]

    def explain(self, prompt_ids: list[int], tenant: str = "") -> dict:
        """What the directory answers for a prompt now (``tide cache explain``): its unit keys
        (hex), how many whole units precede its last token (``cacheable``), the live holders
        (node, tier) of each leading unit the directory finds, and where the model needs a resume
        record after the units it loads (V4), the key of the one after each cacheable unit."""
        keys = self.unit_keys(prompt_ids, tenant)
        cacheable = min(len(keys), (len(prompt_ids) - 1) // UNIT_TOKENS)
        if self._explain_directory is None:
            self._explain_directory = self._open_directory()  # a maintenance path: opened on first use
        listed: list[list[tuple[str, str]]] = []
        if self._explain_directory is not None and cacheable:
            try:
                match = self._explain_directory.longest_prefix([bytes.fromhex(k) for k in keys[:cacheable]])
                listed = [[(h.node_id, h.tier) for h in hs] for hs in match.holders]
            except DirectoryUnavailable as e:
                return {"keys": keys, "cacheable": cacheable, "listed": [], "directory_error": str(e)}
        seed = self.engine.namespace_for(tenant).seed
        resume = [resume_key(seed, bytes.fromhex(k)).hex() for k in keys[:cacheable]] if self.engine.kv.resumable else []
        return {"keys": keys, "cacheable": cacheable, "listed": listed, "resume_keys": resume,
                "directory": self._explain_directory is not None}
