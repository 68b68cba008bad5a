"""The replica's engine loop: one thread steps the engine while callers, on any asyncio event
loop, stream their requests' outputs. No Ray here: ``actors/llm_server.py`` runs one inside a
Serve replica, and tests run it as it is.

A request's stream ends with its finished output; a request handed off to a decode replica (P/D)
ends with a ``PromptKV`` after its last output. A caller that stops reading aborts its request
(its pages are freed at the next step). A step that raises fails the requests in flight with
that error; the loop goes on for the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from cluster.engine import Engine
from cluster.request import GenerationRequest, RequestOutput

__all__ = ["EngineLoop", "PromptKV"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptKV:
    """A handed-off request's prompt KV [L, P, D], the last item of its stream."""

    kv: object


class EngineLoop:
    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None] | None = None,
                 tick: Callable[[], None] | None = None, idle_wait_s: float = 1.0,
                 threads: int | None = None) -> None:
        """``on_output``: called on the loop's thread with every output (usage records);
        ``tick``: called after every step and at least every ``idle_wait_s`` while idle
        (periodic upkeep: directory sync, agent checks). Neither may block for long.
        ``threads``: the torch and OpenMP threads the steps compute with (they are per thread:
        the loop's thread sets them); None: the process's (``threads_used`` says which)."""
        self.engine = engine
        self.threads = threads
        self.threads_used: int | None = None  # set by the loop's thread as it starts
        self.on_output = on_output
        self.tick = tick
        self.idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The thread ends after its current step (requests in flight get nothing more)."""
        self._stopped = True
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def stream(self, req: GenerationRequest) -> AsyncIterator[RequestOutput | PromptKV]:
        """Queue ``req`` (its errors, a duplicate id included, raise here) and yield its outputs
        as the engine makes them."""
        rid = req.request_id
        if rid in self._queues:
            raise ValueError(f"duplicate request id {rid!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(req)
            self._wake.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, PromptKV) or (item.finished and item.handoff is None):
                    return
        finally:
            self._queues.pop(rid, None)
            self.engine.abort(rid)  # a no-op when it finished; frees its pages if the caller left

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight; each stream raises ``error``."""
        for rid in list(self._queues):
            self.engine.abort(rid)
            self._deliver(rid, error)

    def in_flight(self) -> int:
        return len(self._queues)

    def _deliver(self, rid: str, item: RequestOutput | PromptKV | BaseException) -> None:
        entry = self._queues.get(rid)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.threads_used = torch.get_num_threads()
        while not self._stopped:
            if not self.engine.has_work():
                self._wake.wait(timeout=self.idle_wait_s)
                self._wake.clear()
            if self.engine.has_work() and not self._stopped:
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the requests, keep the loop
                    log.exception("engine step failed")
                    self.fail_all(e)
                    continue
                for o in outputs:
                    self._deliver(o.request_id, o)
                    if o.handoff is not None:
                        self._deliver(o.request_id, PromptKV(o.handoff.kv))
                    if self.on_output is not None:
                        _guarded(self.on_output, o)
            if self.tick is not None:
                _guarded(self.tick)


def _guarded(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - upkeep failing must not stop the requests' loop
        log.exception("engine loop callback %s failed", getattr(fn, "__name__", fn))
