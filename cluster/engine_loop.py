"""The replica's engine loop: one thread steps the engine while callers, on any asyncio event
loop, stream their requests' outputs. No Ray here: ``actors/llm_server.py`` runs one inside a
Serve replica, and tests run it as it is.

A request's stream ends with its finished output; a request handed off to a decode replica (P/D)
ends with a ``PromptKV`` after its last output. A caller that stops reading aborts its request
(its pages are freed at the next step). A request that fails alone (its sampling or grammar
raised: ``FinishReason.ERROR``) raises ``RequestFailed`` in its stream while the others go on; a
step that raises fails the requests in flight with that error; the loop goes on for the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from cluster.engine import Engine
from cluster.request import FinishReason, GenerationRequest, RequestFailed, RequestOutput

__all__ = ["EngineLoop", "PromptKV"]

log = logging.getLogger(__name__)

BACKGROUND_INTERVAL_S = 1.0  # a background request's outputs go at most this often (each is a hop's CPU)
IDLE_STEP_WAIT_S = 0.002  # after a step that could do nothing yet, until the next (or a new request)
HELD_STEP_WAIT_S = 0.05  # ... when all it holds is background work waiting for interactive requests to pass


@dataclass(frozen=True, slots=True)
class PromptKV:
    """A handed-off request's prompt KV [L, P, D], the last item of its stream."""

    kv: object


class _Inbox:
    """A stream's items, put by the engine's thread and taken on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque = deque()
        self.arrived = asyncio.Event()

    def put(self, item) -> None:
        """From any thread."""
        self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item) -> None:
        self.items.append(item)
        self.arrived.set()

    async def get(self, deadline: float | None = None):
        """The next item, waiting for it until ``deadline`` (the loop's time; None: however
        long), or None when it passed first. The wait takes nothing, so a wait cut short by
        the deadline loses no item."""
        while not self.items:
            self.arrived.clear()
            if deadline is None:
                await self.arrived.wait()
                continue
            left = deadline - self.loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                return None
        return self.items.popleft()


class EngineLoop:
    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None] | None = None,
                 tick: Callable[[], None] | None = None, idle_wait_s: float = 1.0,
                 threads: int | None = None, stream_batching_interval_s: float = 0.0) -> None:
        """``on_output``: called on the loop's thread with every output (usage records);
        ``tick``: called after every step and at least every ``idle_wait_s`` while idle
        (periodic upkeep: directory sync, agent checks). Neither may block for long.
        ``threads``: the torch and OpenMP threads the steps compute with (they are per thread:
        the loop's thread sets them); None: the process's (``threads_used`` says which).
        ``stream_batching_interval_s``: the least time between two outputs of a stream (``stream``)."""
        self.engine = engine
        self.stream_batching_interval_s = stream_batching_interval_s
        self.threads = threads
        self.threads_used: int | None = None  # set by the loop's thread as it starts
        self.on_output = on_output
        self.tick = tick
        self.idle_wait_s = idle_wait_s
        self._inboxes: dict[str, _Inbox] = {}
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
        as the engine makes them: the first at once, each later one ``stream_batching_interval_s``
        at the earliest after the one before, with what came meanwhile joined to it
        (``RequestOutput.then``: the same tokens and text in fewer, longer outputs; a finished
        one goes at once). Every output costs its caller a hop (the Serve replica's, the
        ingress's, the HTTP proxy's), however few tokens it holds: an engine that steps faster
        than the interval pays them per interval, not per token. A background request's (a batch
        line's: no one reads it as it comes) go ``BACKGROUND_INTERVAL_S`` apart at the least."""
        rid = req.request_id
        interval_s = max(self.stream_batching_interval_s, BACKGROUND_INTERVAL_S if req.background else 0.0)
        if rid in self._inboxes:
            raise ValueError(f"duplicate request id {rid!r}")
        loop = asyncio.get_running_loop()
        inbox = self._inboxes[rid] = _Inbox(loop)
        pending = None  # an item taken that could not join the output before it
        sent = float("-inf")  # when the last output went
        try:
            self.engine.add_request(req)
            self._wake.set()
            while True:
                item, pending = (pending, None) if pending is not None else (await inbox.get(), None)
                # join what comes until the interval since the last output is up (or it finishes)
                while isinstance(item, RequestOutput) and not item.finished:
                    later = await inbox.get(sent + interval_s)
                    if later is None:
                        break
                    if not isinstance(later, RequestOutput):
                        pending = later
                        break
                    item = item.then(later)
                if isinstance(item, BaseException):
                    raise item
                yield item
                sent = loop.time()
                if isinstance(item, PromptKV) or (item.finished and item.handoff is None):
                    return
        finally:
            self._inboxes.pop(rid, None)
            self.engine.abort(rid)  # a no-op when it finished; frees its pages if the caller left

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight; each stream raises ``error``."""
        for rid in list(self._inboxes):
            self.engine.abort(rid)
            self._deliver(rid, error)

    def in_flight(self) -> int:
        return len(self._inboxes)

    def _deliver(self, rid: str, item: RequestOutput | PromptKV | BaseException) -> None:
        inbox = self._inboxes.get(rid)
        if inbox is not None:
            inbox.put(item)

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
                if self.engine.idle and not outputs:  # waiting on a grammar's compile: do not spin
                    self._wake.wait(timeout=HELD_STEP_WAIT_S if self.engine.background_only() else IDLE_STEP_WAIT_S)
                    self._wake.clear()
                for o in outputs:
                    if o.finish_reason == FinishReason.ERROR:  # it failed alone: its stream raises
                        self._deliver(o.request_id, RequestFailed(o.error or "the request failed"))
                        continue
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
