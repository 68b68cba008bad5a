"""``BatchRunner``: runs the cluster's batch jobs from one ingress replica.

Every ``poll_s`` it takes the lease of each job not ended that no live runner holds, and runs it:
validation (the input read, each line prepared as its route prepares it, the tokens checked
against the limits, the run order planned by shared prefix), then the lines, ``batch_concurrency``
at once, a prefix group's first line before the rest, each result recorded once; then the output
and error files. The lease is renewed every third of ``LEASE_S``; a runner that loses it stops,
and the job's next holder goes on from the results recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections import deque

from cluster.batch import BatchJob, BatchLine, BatchStatus, LineResult, parse_input, prefix_groups
from cluster.units import UNIT_TOKENS
from deploy.batch_store import StoreUnavailable
from deploy.errors import APIError, error_body
from deploy.ingress.batches import KEEP_ENDED_S, LEASE_S, SAVE_S, Batches
from deploy.request_cost import RequestCost

__all__ = ["BatchRunner", "SWEEP_S"]

log = logging.getLogger(__name__)

SWEEP_S = 3600.0  # expired files' bodies are removed this often
CANCEL_GRACE_S = 60.0  # a cancelled or expired job's lines under way get this long to finish


class BatchRunner:
    def __init__(self, batches: Batches, poll_s: float = 1.0, holder: str | None = None) -> None:
        self.batches, self.store, self.files = batches, batches.store, batches.files
        self.limits, self.clock, self.poll_s = batches.limits, batches.clock, poll_s
        self.holder = holder or secrets.token_hex(8)  # this runner, in the leases it holds
        self._jobs: dict[str, asyncio.Task] = {}
        self._swept = 0.0
        # for /metrics: lines waiting in this runner's jobs, under way, and done by outcome
        self.queued, self.running = 0, 0
        self.done = {"completed": 0, "failed": 0}

    async def serve(self) -> None:
        """Poll for jobs until cancelled."""
        while True:
            try:
                await self.poll()
            except StoreUnavailable as e:
                log.warning("batch runner: %s", e)
            await asyncio.sleep(self.poll_s)

    async def poll(self) -> None:
        """Take every job not ended that no live runner holds."""
        for tenant, bid in await asyncio.to_thread(self.store.active):
            task = self._jobs.get(bid)
            if task is not None and not task.done():
                continue
            if await asyncio.to_thread(self.store.lease, tenant, bid, self.holder, LEASE_S):
                self._jobs[bid] = asyncio.create_task(self._hold(tenant, bid))
        if self.clock() - self._swept > SWEEP_S:
            self._swept = self.clock()
            await asyncio.to_thread(self.files.sweep)

    async def idle(self) -> None:
        """Wait until the jobs this runner holds have stopped (tests, shutdown)."""
        await asyncio.gather(*self._jobs.values(), return_exceptions=True)

    async def _hold(self, tenant: str, bid: str) -> None:
        """Run the job while renewing its lease; stop it if the lease is lost."""
        run = asyncio.create_task(self.run(tenant, bid))
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=LEASE_S / 3)
                if not run.done() and not await asyncio.to_thread(self.store.lease, tenant, bid, self.holder, LEASE_S):
                    log.warning("batch %s: lease lost; another runner goes on with it", bid)
                    run.cancel()
        finally:
            run.cancel()  # this holder stopped (shutdown): so does its run; a no-op once it ended
        with contextlib.suppress(asyncio.CancelledError):
            exc = run.exception()
            if exc is not None and not isinstance(exc, StoreUnavailable):
                log.error("batch %s failed in its runner", bid, exc_info=exc)

    async def run(self, tenant: str, bid: str) -> None:
        job = await asyncio.to_thread(self.store.get, tenant, bid)
        if job is None or job.status.ended:
            if job is not None:
                await self._save(job)  # ended but still listed: leave the list
            return
        lines = await self._lines(job)
        if lines is None:
            return
        if job.status == BatchStatus.VALIDATING and not await self._validate(job, lines):
            return
        groups = await asyncio.to_thread(self.store.plan, job)
        final = await self._work(job, lines, groups or [[line.index] for line in lines])
        await self._finish(job, lines, final)

    async def _lines(self, job: BatchJob) -> list[BatchLine] | None:
        data = await asyncio.to_thread(self.files.content, job.tenant, job.input_file_id)
        if data is None:
            await self._fail(job, "input_file_gone", f"the input file {job.input_file_id} was deleted or expired")
            return None
        lines, errors = await asyncio.to_thread(parse_input, data, job.endpoint, self.limits.max_batch_lines)
        if errors:
            job.errors = [e.to_openai() for e in errors]
            await self._fail(job)
            return None
        return lines

    async def _fail(self, job: BatchJob, code: str | None = None, message: str | None = None) -> None:
        """End the job ``failed`` (``code``/``message``: its error, where ``job.errors`` has none)."""
        if code is not None:
            job.errors = [{"code": code, "line": None, "message": message, "param": None}]
        job.enter(BatchStatus.FAILED, int(self.clock()))
        await self._save(job)

    async def _validate(self, job: BatchJob, lines: list[BatchLine]) -> bool:
        """Count the lines' tokens against the limits and plan their order; False: the job failed."""
        prompts, tokens = [], 0
        for line in lines:
            try:
                prepared, _ = await self.batches.prepared(job, line)
            except APIError:
                prompts.append(())  # refused when it runs: a line of the error file
                continue
            prompts.append(prepared.requests[0].prompt_ids)
            tokens += RequestCost.of(list(prepared.requests), prepared.n).tokens
        limit = self.limits.max_batch_tokens
        if tokens > limit:
            await self._fail(job, "token_limit_exceeded",
                             f"the batch may cost {tokens} tokens, more than limits.max_batch_tokens ({limit})")
            return False
        if self.limits.tenant_batch_tokens:
            others = sum(j.reserved_tokens for j in await asyncio.to_thread(self.store.list, job.tenant)
                         if not j.status.ended and j.id != job.id)
            if others + tokens > self.limits.tenant_batch_tokens:
                await self._fail(job, "token_limit_exceeded",
                                 f"the tenant's batches not ended would cost {others + tokens} tokens, more than "
                                 f"limits.tenant_batch_tokens ({self.limits.tenant_batch_tokens})")
                return False
        job.total, job.reserved_tokens = len(lines), tokens
        job.model = next((str(line.body["model"]) for line in lines if "model" in line.body), None)
        await asyncio.to_thread(self.store.set_plan, job, prefix_groups(prompts, UNIT_TOKENS), KEEP_ENDED_S)
        job.enter(BatchStatus.IN_PROGRESS, int(self.clock()))
        await self._save(job)
        return True

    async def _work(self, job: BatchJob, lines: list[BatchLine], groups: list[list[int]]) -> BatchStatus:
        """Run the lines not done yet; the status the job ends with."""
        done = await asyncio.to_thread(self.store.results, job)
        job.completed = job.failed = job.input_tokens = job.cached_tokens = job.output_tokens = 0
        for result in done.values():
            job.count(result)
        ready: deque[int] = deque()
        after: dict[int, list[int]] = {}  # a group's first line -> the lines that wait for it
        for group in groups:
            pending = [i for i in group if i not in done]
            if group[0] in done:
                ready.extend(pending)
            elif pending:
                ready.append(group[0])
                after[group[0]] = pending[1:]
        state = {"stop": None, "inflight": 0}
        state["stop"] = await self._checkpoint(job)  # cancelled or expired while it waited
        changed = asyncio.Event()
        self.queued += len(ready) + sum(map(len, after.values()))

        async def worker() -> None:
            while state["stop"] is None:
                if not ready:
                    if not state["inflight"]:
                        return
                    changed.clear()
                    await changed.wait()
                    continue
                i = ready.popleft()
                state["inflight"] += 1
                self.queued, self.running = self.queued - 1, self.running + 1
                try:
                    await self._line(job, lines[i])
                finally:
                    state["inflight"] -= 1
                    self.running -= 1
                ready.extendleft(reversed(after.pop(i, [])))
                changed.set()

        workers = [asyncio.create_task(worker()) for _ in range(self.limits.batch_concurrency)]
        watcher = asyncio.create_task(self._watch(job, state, changed, workers))
        try:
            for outcome in await asyncio.gather(*workers, return_exceptions=True):
                if isinstance(outcome, Exception):
                    raise outcome
        finally:
            watcher.cancel()
            self.queued -= len(ready) + sum(map(len, after.values()))
        return state["stop"] or BatchStatus.COMPLETED

    async def _watch(self, job: BatchJob, state: dict, changed: asyncio.Event, workers: list[asyncio.Task]) -> None:
        """Every ``SAVE_S``: save the job's counts and see whether it was cancelled or expired.
        Then the idle workers leave, and the lines under way get ``CANCEL_GRACE_S`` to finish
        before they are stopped (one that no replica takes would hold the job forever)."""
        while state["stop"] is None:
            await asyncio.sleep(SAVE_S)
            state["stop"] = await self._checkpoint(job)
        changed.set()
        await asyncio.sleep(CANCEL_GRACE_S)
        for task in workers:
            task.cancel()

    async def _line(self, job: BatchJob, line: BatchLine) -> None:
        result = await self.batches.run_line(job, line)
        if await asyncio.to_thread(self.store.record, job, result):
            job.count(result)
            self.done["completed" if result.ok else "failed"] += 1

    async def _checkpoint(self, job: BatchJob) -> BatchStatus | None:
        """Save the counts; the status to stop with when the job was cancelled or its window has
        passed."""
        now = self.clock()
        if await asyncio.to_thread(self.store.cancelled, job.tenant, job.id):
            return BatchStatus.CANCELLED
        if now > job.expires_at:
            return BatchStatus.EXPIRED
        await self._save(job)
        return None

    async def _finish(self, job: BatchJob, lines: list[BatchLine], final: BatchStatus) -> None:
        """Write the output and error files (lines in input order) and end the job."""
        if await asyncio.to_thread(self.store.cancelled, job.tenant, job.id):
            final = BatchStatus.CANCELLED
        job.enter(BatchStatus.CANCELLING if final == BatchStatus.CANCELLED else BatchStatus.FINALIZING, int(self.clock()))
        await self._save(job)
        results = await asyncio.to_thread(self.store.results, job)
        if final == BatchStatus.EXPIRED:  # OpenAI lists the lines an expired batch did not run
            for line in lines:
                results.setdefault(line.index, LineResult(line.index, line.custom_id, 0, error_body(
                    "the batch's completion window passed before this line ran", "batch_expired", None, "batch_expired")))
        ttl = job.output_expires_s or self.limits.file_ttl_s
        for ok, attr, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            rows = [results[i].to_openai(job.id) for i in sorted(results) if results[i].ok == ok]
            if rows:
                data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
                record = await asyncio.to_thread(self.files.put, job.tenant, f"{job.id}_{suffix}.jsonl",
                                                 "batch_output", data, ttl)
                setattr(job, attr, record.id)
        job.enter(final, int(self.clock()))
        await self._save(job)
        await asyncio.to_thread(self.store.drop_work, job)

    async def _save(self, job: BatchJob) -> None:
        await asyncio.to_thread(self.store.save, job, KEEP_ENDED_S)

