"""One prefix plan per prompt (``cluster.request.PrefixPlan``): the prompt hashed once, one
directory round trip, and the live holders' addresses, made before its choices fan out and kept
by every choice and every retry, so a replica neither hashes nor asks the directory again."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from cachedir.directory.base import Directory, DirectoryUnavailable
from cachedir.hashing import Namespace, chain_keys
from cluster.request import UNIT_TOKENS, GenerationRequest, PrefixPlan

__all__ = ["Planner"]

LIVE_TTL_S = 1.0  # how old the list of live nodes (and their agents' addresses) may be


class Planner:
    """Plans prompts in ``namespace`` against ``directory`` (None: no plans; the replicas look
    units up themselves)."""

    def __init__(self, directory: Directory | None, namespace: Namespace | None, live_ttl_s: float = LIVE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if directory is not None and namespace is None:
            raise ValueError("a planner with a directory needs the cache namespace")
        self.directory, self.namespace = directory, namespace
        self._live_ttl_s, self._clock = live_ttl_s, clock
        self._live: tuple[float, dict[str, str]] = (float("-inf"), {})

    def _namespace(self, tenant: str) -> Namespace:
        return self.namespace.for_tenant(tenant) if tenant else self.namespace

    async def planned(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its prompt's plan (unchanged without a directory or a whole unit)."""
        plan = await self.plan(req)
        return req if plan is None else dataclasses.replace(req, plan=plan)

    async def plan(self, req: GenerationRequest) -> PrefixPlan | None:
        """The prompt's plan: the keys of its whole units and the live holders of the leading
        ones the directory finds (the prompt's last token is always computed, so only units
        before it; none for a prompt scored whole). A directory that fails gives a plan with no
        holders (every unit computed)."""
        if self.directory is None or len(req.prompt_ids) < UNIT_TOKENS:
            return None
        ns = self._namespace(req.tenant)
        keys = tuple(chain_keys(ns.seed, req.prompt_ids, UNIT_TOKENS))
        usable = (len(req.prompt_ids) - 1) // UNIT_TOKENS
        if req.sampling.prompt_logprobs is not None:  # scored whole: nothing cached is used
            usable = 0
        if not usable:
            return PrefixPlan(keys, namespace=ns.id)
        try:
            holders, dropped, addresses = await asyncio.to_thread(self._ask, keys[:usable])
        except DirectoryUnavailable:
            return PrefixPlan(keys, namespace=ns.id)
        return PrefixPlan(keys, holders, dropped_next=dropped, namespace=ns.id, addresses=addresses)

    def _ask(self, keys: tuple[bytes, ...]) -> tuple[tuple[tuple[str, ...], ...], bool, tuple[tuple[str, str], ...]]:
        match = self.directory.longest_prefix(keys)
        holders = tuple(tuple(h.node_id for h in hs) for hs in match.holders)
        live = self._live_nodes()
        named = sorted({node for hs in holders for node in hs if node in live})
        return holders, match.dropped_next, tuple((node, live[node]) for node in named)

    def _live_nodes(self) -> dict[str, str]:
        """Live node -> its agent's address, at most ``live_ttl_s`` old (an unreachable list: none)."""
        at, live = self._live
        if self._clock() - at > self._live_ttl_s:
            try:
                live = self.directory.live_nodes()
            except DirectoryUnavailable:
                live = {}
            self._live = (self._clock(), live)
        return live

    def continued(self, req: GenerationRequest, emitted: tuple[int, ...]) -> PrefixPlan | None:
        """The plan of ``req`` continued elsewhere after ``emitted`` tokens: its prompt grew, so
        its keys are those of the longer prompt (hashing only); what the directory said of the
        prompt's units still holds, and the next replica's router decides the load again."""
        plan = req.plan
        if plan is None:
            return None
        keys = tuple(chain_keys(self._namespace(req.tenant).seed, req.prompt_ids + emitted, UNIT_TOKENS))
        return dataclasses.replace(plan, unit_keys=keys, load_units=None)
