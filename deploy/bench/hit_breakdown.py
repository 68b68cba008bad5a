"""Where a prompt-cache hit's time goes, for ``tide bench ttft``: the engine's and the cache's calls
wrapped and timed around one hit (the bench's own instrument: nothing in the engine measures
itself for it)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from cachedir.agent.cluster_cache import ClusterCache
from cluster.engine import Engine

__all__ = ["Spans", "hit_breakdown"]


class Spans:
    """Where one hit's time goes: the engine's calls wrapped and timed (the bench's own
    instrument: nothing in the engine measures itself for it)."""

    def __init__(self, engine: Engine, cache: ClusterCache) -> None:
        self.s: dict[str, float] = {"lookup": 0.0, "admit": 0.0, "page_copies": 0.0, "suffix_compute": 0.0,
                                    "load": 0.0}
        self._undo: list = []  # (object, attribute) set here
        self._wrap(engine, "add_request", "lookup")
        self._wrap(engine.scheduler, "_admit", "admit")  # the scheduler admits through the engine's
        self._wrap(engine.kv, "write_unit", "page_copies")
        model = engine.model
        spans = self

        class Timed:
            def __getattr__(self, name):
                return getattr(model, name)

            def prefill(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return model.prefill(*a, **k)
                finally:
                    spans.s["suffix_compute"] += time.perf_counter() - t0

        engine.model = Timed()
        load_async = cache.load_async

        def timed_load(*a, **k):
            t0 = time.perf_counter()
            fut = load_async(*a, **k)
            fut.add_done_callback(lambda _: self.s.__setitem__("load", time.perf_counter() - t0))
            return fut

        cache.load_async = timed_load
        self._undo.append((cache, "load_async"))

    def close(self) -> None:
        """Let go of the shared cache: its own ``load_async`` again (the engine is the hit's own)."""
        for obj, name in self._undo:
            delattr(obj, name)

    def _wrap(self, obj, name: str, span: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.s[span] += time.perf_counter() - t0

        setattr(obj, name, timed)


def hit_breakdown(runs: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """Medians (ms) of the hits' parts: the lookup (hashing, the agent's and the directory's
    answers, the load's start), the load (from its start to its last unit verified), the wait for
    it when the prompt was admitted, the copies of its units into pages, the suffix's compute,
    and what is left (``other``: scheduling, sampling, the output); ``fixed``: the hit's time
    beyond its load and its suffix's compute."""
    def med(f) -> float:
        return round(statistics.median(f(t, s) for t, s in runs) * 1e3, 2)

    return {
        "ttft_ms": med(lambda t, s: t), "lookup_ms": med(lambda t, s: s["lookup"]), "load_ms": med(lambda t, s: s["load"]),
        "load_wait_ms": med(lambda t, s: s["admit"] - s["page_copies"]),
        "page_copies_ms": med(lambda t, s: s["page_copies"]), "suffix_compute_ms": med(lambda t, s: s["suffix_compute"]),
        "other_ms": med(lambda t, s: t - s["lookup"] - s["admit"] - s["suffix_compute"]),
        "fixed_ms": med(lambda t, s: t - s["load"] - s["suffix_compute"]),
    }
