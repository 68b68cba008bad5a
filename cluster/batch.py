"""Batch jobs (OpenAI's Batch API): what a job is, how its input file is read, in which order its
lines run, and the shapes of what it returns. No I/O: ``deploy.batch_store`` keeps jobs and files,
``deploy.ingress.batches`` runs them.

A job moves ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; an input that is
not a batch file ends it ``failed`` (``errors`` name the lines), a cancel ends it ``cancelling`` ->
``cancelled`` and a job still running past its window ends ``expired``, each with the lines done so
far in its output and error files. A line that fails (its body refused, its request failed) is a
line of the error file and never aborts the job.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ENDPOINTS", "WINDOW_S", "BatchJob", "BatchLine", "BatchStatus", "InputError", "LineResult",
           "parse_input", "prefix_groups"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WINDOW_S = {"24h": 24 * 3600}  # completion windows (OpenAI's: 24h only)
MAX_CUSTOM_ID = 512
MAX_ERRORS = 20  # input errors a failed job lists (the first ones)


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of an input file: its 0-based ``index`` among the file's lines."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class InputError:
    """Why an input file is not a batch of ``endpoint`` (OpenAI's ``BatchError``)."""

    line: int | None  # 1-based, as OpenAI counts them
    message: str
    code: str = "invalid_request"
    param: str | None = None

    def to_openai(self) -> dict:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


def parse_input(raw: bytes, endpoint: str, max_lines: int) -> tuple[list[BatchLine], list[InputError]]:
    """The lines of an input file, or why it is not a batch of ``endpoint``: every non-blank line a
    JSON object with a unique ``custom_id``, ``method`` POST, ``url`` the batch's endpoint and a
    ``body`` object. The bodies themselves are checked when each line runs."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [InputError(None, f"the file is not UTF-8 text: {e}", "invalid_file")]
    lines: list[BatchLine] = []
    errors: list[InputError] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            return [], [InputError(None, f"the file has more than {max_lines} requests (limits.max_batch_lines)",
                                   "too_many_requests")]
        parsed, error = _line(line, number, endpoint, len(lines), seen)
        if error is not None:
            errors.append(error)
        else:
            lines.append(parsed)
    if not lines and not errors:
        errors.append(InputError(None, "the file has no requests", "empty_file"))
    return lines, errors[:MAX_ERRORS]


def _line(line: str, number: int, endpoint: str, index: int, seen: set[str]) -> tuple[BatchLine | None, InputError | None]:
    try:
        obj = json.loads(line)
    except ValueError as e:
        return None, InputError(number, f"line {number} is not JSON: {e}", "invalid_json_line")
    if not isinstance(obj, dict):
        return None, InputError(number, f"line {number} is not a JSON object", "invalid_json_line")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return None, InputError(number, f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} "
                                        "characters", param="custom_id")
    if custom_id in seen:
        return None, InputError(number, f"line {number}: custom_id {custom_id!r} is used twice",
                                "duplicate_custom_id", "custom_id")
    if obj.get("method") != "POST":
        return None, InputError(number, f"line {number}: method must be POST, got {obj.get('method')!r}",
                                param="method")
    if obj.get("url") != endpoint:
        return None, InputError(number, f"line {number}: url {obj.get('url')!r} is not the batch's endpoint "
                                        f"{endpoint}", "mismatched_endpoint", "url")
    if not isinstance(obj.get("body"), dict):
        return None, InputError(number, f"line {number}: body must be a JSON object", param="body")
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        return None, InputError(number, f"line {number}: unknown fields {sorted(extra)}", param=sorted(extra)[0])
    seen.add(custom_id)
    return BatchLine(index, custom_id, endpoint, obj["body"]), None


def prefix_groups(prompts: list[tuple[int, ...]], unit_tokens: int) -> list[list[int]]:
    """The lines' run order, as groups: lines sorted by prompt (so that shared prefixes are
    neighbours), a group's lines sharing at least one whole unit with its first. A group's first
    line runs before the rest, which then find its prefix cached: it is computed once.
    ``prompts``: each line's prompt token ids (empty for a line that will fail)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and _shared(prompts[groups[-1][0]], prompts[i]) >= unit_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n if n < min(len(a), len(b)) else n - 1  # a prompt's last token is always computed


@dataclass(frozen=True, slots=True)
class LineResult:
    """A line's outcome: the HTTP status and body its request got (``ok``: a 2xx, a line of the
    output file; else of the error file; 0: it never ran, ``body`` says why) and its tokens."""

    index: int
    custom_id: str
    status: int
    body: dict[str, Any]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> LineResult:
        return cls(**json.loads(raw))

    def to_openai(self, batch_id: str) -> dict:
        """The line of the output or error file, OpenAI's shape."""
        tag = f"{batch_id.removeprefix('batch_')}_{self.index}"
        if not self.status:
            error = self.body.get("error", {})
            return {"id": f"batch_req_{tag}", "custom_id": self.custom_id, "response": None,
                    "error": {"code": error.get("code"), "message": error.get("message")}}
        return {"id": f"batch_req_{tag}", "custom_id": self.custom_id,
                "response": {"status_code": self.status, "request_id": f"req_{tag}", "body": self.body},
                "error": None}


@dataclass(slots=True)
class BatchJob:
    """A batch as kept (``encode``) and as OpenAI shows it (``to_openai``)."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, str] | None = None
    output_expires_s: int | None = None  # the output and error files' lifetime (None: the default)
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was entered
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[dict] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    model: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reserved_tokens: int = 0  # what its lines may cost (their requests' costs), counted at validation
    models: list[str] | None = None  # the models its creator's key may use (None: all)

    @classmethod
    def new(cls, tenant: str, endpoint: str, input_file_id: str, window: str, now: int, **kw) -> BatchJob:
        return cls(f"batch_{secrets.token_hex(12)}", tenant, endpoint, input_file_id, window, now, **kw)

    @property
    def expires_at(self) -> int:
        return self.created_at + WINDOW_S[self.completion_window]

    @property
    def tokens_left(self) -> int:
        """What its lines not done yet may cost (its reserved tokens, pro rata)."""
        if not self.total:
            return self.reserved_tokens
        return self.reserved_tokens * (self.total - self.completed - self.failed) // self.total

    def enter(self, status: BatchStatus, now: int) -> None:
        self.status = status
        self.times[status.value] = now

    def count(self, result: LineResult) -> None:
        if result.ok:
            self.completed += 1
        else:
            self.failed += 1
        self.input_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        self.output_tokens += result.completion_tokens

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> BatchJob:
        d = json.loads(raw)
        d["status"] = BatchStatus(d["status"])
        return cls(**d)

    def to_openai(self) -> dict:
        t = self.times
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.value, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": t.get("in_progress"), "expires_at": self.expires_at,
            "finalizing_at": t.get("finalizing"), "completed_at": t.get("completed"), "failed_at": t.get("failed"),
            "expired_at": t.get("expired"), "cancelling_at": t.get("cancelling"), "cancelled_at": t.get("cancelled"),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
            "metadata": self.metadata,
        }
