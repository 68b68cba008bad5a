"""Where batch jobs and their files are kept: state in the cluster's Redis, file bodies on disk.

``FileStore``: uploaded files (``/v1/files``) and the output and error files batches write.
A file's record (OpenAI's ``FileObject``) lives in Redis with its expiry; its bytes in
``root/<tenant digest>/<file id>`` (a directory every ingress replica reaches: one node's disk
for a single-node cluster, shared storage beyond). A body whose record expired is removed by
``sweep``.

``BatchStore``: each job's state (``cluster.batch.BatchJob``), its run order, and its lines'
results — one hash field per line, set only if absent, so a line that two runners finished is
recorded once — plus a lease that one ingress replica holds while it runs the job (a replica
that dies loses it, and another takes the job over from the results recorded).

Both sit on a ``deploy.state_kv.KV``: Redis, or this ingress's memory for a cluster without one
(lost when it restarts). Keys carry the tenant: one tenant never reads, lists or cancels another's
files and batches. Redis failing raises ``StoreUnavailable``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.batch import BatchJob, LineResult
from deploy.response_store import StoreUnavailable
from deploy.state_kv import KV, MemoryKV, RedisKV

__all__ = ["BatchStore", "FileRecord", "FileStore", "KV", "MemoryKV", "RedisKV", "StoreUnavailable"]

@dataclass(frozen=True, slots=True)
class FileRecord:
    """A file as OpenAI's ``FileObject`` shows it."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}


TENANT_MARKER = ".tenant"


def _tag(tenant: str) -> str:
    return tenant or "_"


class FileStore:
    def __init__(self, kv: KV, root: str | Path, namespace: str, clock=time.time) -> None:
        self.kv, self.root, self.ns, self._clock = kv, Path(root), namespace, clock

    def _key(self, tenant: str, fid: str) -> str:
        return f"{self.ns}:files:{{{_tag(tenant)}}}:{fid}"

    def _index(self, tenant: str) -> str:
        return f"{self.ns}:files:{{{_tag(tenant)}}}"

    def _path(self, tenant: str, fid: str) -> Path:
        return self.root / hashlib.sha256(tenant.encode()).hexdigest()[:32] / fid

    def put(self, tenant: str, filename: str, purpose: str, data: bytes, expires_s: int) -> FileRecord:
        """Keep ``data`` as a new file of ``tenant``'s for ``expires_s`` seconds; its bytes reach
        the disk (fsync) before its record exists."""
        at = self._clock()
        now = int(at)
        record = FileRecord(f"file-{secrets.token_hex(12)}", len(data), now, filename, purpose, now + expires_s)
        path = self._path(tenant, record.id)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker = path.parent / TENANT_MARKER  # whose files these are (sweep reads it)
        if not marker.is_file():
            with os.fdopen(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(tenant)
        tmp = path.with_suffix(".part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.kv.set(self._key(tenant, record.id), json.dumps(asdict(record)), ex_s=expires_s)
        self.kv.zadd(self._index(tenant), at, record.id)
        return record

    def get(self, tenant: str, fid: str) -> FileRecord | None:
        raw = self.kv.get(self._key(tenant, fid))
        return None if raw is None else FileRecord(**json.loads(raw))

    def content(self, tenant: str, fid: str) -> bytes | None:
        """The file's bytes (None: no such file of this tenant's, or it expired)."""
        if self.get(tenant, fid) is None:
            return None
        try:
            return self._path(tenant, fid).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, tenant: str, purpose: str | None = None) -> list[FileRecord]:
        """``tenant``'s live files, oldest first (forgetting those that expired)."""
        out = []
        for fid in self.kv.zrange(self._index(tenant)):
            record = self.get(tenant, fid.decode())
            if record is None:
                self.kv.zrem(self._index(tenant), fid.decode())
            elif purpose is None or record.purpose == purpose:
                out.append(record)
        return out

    def delete(self, tenant: str, fid: str) -> bool:
        if self.get(tenant, fid) is None:
            return False
        self.kv.delete(self._key(tenant, fid))
        self.kv.zrem(self._index(tenant), fid)
        self._path(tenant, fid).unlink(missing_ok=True)
        return True

    def sweep(self) -> int:
        """Remove the bodies of files whose records expired or were deleted, and uploads left
        half-written for a day; returns how many."""
        removed = 0
        for tenant_dir in self.root.iterdir() if self.root.is_dir() else ():
            marker = tenant_dir / TENANT_MARKER
            if not marker.is_file():
                continue
            tenant = marker.read_text()
            for path in tenant_dir.iterdir():
                if path.name == TENANT_MARKER:
                    continue
                gone = path.stat().st_mtime < self._clock() - 86400 if path.suffix == ".part" \
                    else self.get(tenant, path.name) is None
                if gone:
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed


class BatchStore:
    def __init__(self, kv: KV, namespace: str) -> None:
        self.kv, self.ns = kv, namespace

    def _key(self, tenant: str, bid: str, part: str = "job") -> str:
        return f"{self.ns}:batches:{{{_tag(tenant)}}}:{bid}:{part}"

    def _index(self, tenant: str) -> str:
        return f"{self.ns}:batches:{{{_tag(tenant)}}}"

    @property
    def _active(self) -> str:
        return f"{self.ns}:batches:active"

    @property
    def _all(self) -> str:
        return f"{self.ns}:batches:all"

    def create(self, job: BatchJob, ttl_s: int) -> None:
        self.save(job, ttl_s)
        self.kv.zadd(self._index(job.tenant), job.created_at, job.id)
        member = json.dumps([job.tenant, job.id])
        self.kv.zadd(self._active, job.created_at, member)
        self.kv.zadd(self._all, job.created_at, member)

    def save(self, job: BatchJob, ttl_s: int) -> None:
        """Keep ``job``'s state (an ended one leaves the runners' list)."""
        self.kv.set(self._key(job.tenant, job.id), job.encode(), ex_s=ttl_s)
        if job.status.ended:
            self.kv.zrem(self._active, json.dumps([job.tenant, job.id]))

    def get(self, tenant: str, bid: str) -> BatchJob | None:
        raw = self.kv.get(self._key(tenant, bid))
        return None if raw is None else BatchJob.decode(raw)

    def list(self, tenant: str) -> list[BatchJob]:
        """``tenant``'s batches, oldest first."""
        out = []
        for bid in self.kv.zrange(self._index(tenant)):
            job = self.get(tenant, bid.decode())
            if job is None:
                self.kv.zrem(self._index(tenant), bid.decode())
            else:
                out.append(job)
        return out

    def active(self) -> list[tuple[str, str]]:
        """(tenant, batch id) of every job not ended, oldest first."""
        return [tuple(json.loads(m)) for m in self.kv.zrange(self._active)]

    def every(self) -> list[BatchJob]:
        """Every tenant's jobs still kept, oldest first (the operators' view)."""
        out = []
        for member in self.kv.zrange(self._all):
            tenant, bid = json.loads(member)
            job = self.get(tenant, bid)
            if job is None:
                self.kv.zrem(self._all, member.decode())
            else:
                out.append(job)
        return out

    def lease(self, tenant: str, bid: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease on running ``bid`` (False: another holder has it)."""
        return self.kv.lease(self._key(tenant, bid, "lease"), holder, int(ttl_s * 1000))

    def cancel(self, tenant: str, bid: str, ttl_s: int) -> None:
        self.kv.set(self._key(tenant, bid, "cancel"), "1", ex_s=ttl_s)

    def cancelled(self, tenant: str, bid: str) -> bool:
        return self.kv.get(self._key(tenant, bid, "cancel")) is not None

    def set_plan(self, job: BatchJob, groups: list[list[int]], ttl_s: int) -> None:
        self.kv.set(self._key(job.tenant, job.id, "plan"), json.dumps(groups), ex_s=ttl_s)

    def plan(self, job: BatchJob) -> list[list[int]] | None:
        raw = self.kv.get(self._key(job.tenant, job.id, "plan"))
        return None if raw is None else json.loads(raw)

    def record(self, job: BatchJob, result: LineResult) -> bool:
        """Keep a line's result unless one is kept already (False: this one is dropped)."""
        return self.kv.hsetnx(self._key(job.tenant, job.id, "results"), str(result.index), result.encode())

    def results(self, job: BatchJob) -> dict[int, LineResult]:
        return {int(k): LineResult.decode(v) for k, v in self.kv.hgetall(self._key(job.tenant, job.id, "results")).items()}

    def drop_work(self, job: BatchJob) -> None:
        """Forget an ended job's plan, results and flags (its files hold the results)."""
        self.kv.delete(*(self._key(job.tenant, job.id, part) for part in ("plan", "results", "cancel", "lease")))
