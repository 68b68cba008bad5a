"""A request's CPU work before a replica sees it, off the ingress's event loop.

Chat templates, tokenizing and grammar checks cost milliseconds to seconds a request (a long
prompt, a large schema); on the event loop they would stall every stream the ingress relays.
``PrepPool.run`` does them on a pool of threads, at most ``per_tenant`` of one tenant's at once:
a tenant that sends many heavy requests queues behind itself, while other tenants' requests
take the pool's other threads."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["PrepPool"]

T = TypeVar("T")


class PrepPool:
    def __init__(self, workers: int, per_tenant: int) -> None:
        if per_tenant > workers:
            raise ValueError(f"per_tenant ({per_tenant}) must not exceed workers ({workers})")
        self.workers, self.per_tenant = workers, per_tenant
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ingress-prep")
        self._slots: dict[str, asyncio.Semaphore] = {}  # a tenant's: made on its first request

    async def run(self, tenant: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on a pool thread once ``tenant`` has a free slot; its result
        (or its exception, raised here)."""
        slots = self._slots.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        async with slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
