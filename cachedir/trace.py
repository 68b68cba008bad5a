"""Trace replay: a request trace through the real admission policies and capacity index.

Input: Mooncake-format JSON lines — ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (each id a 512-token block, chained from the start; the last block may be partial).
Each block expands into ``block_tokens // unit_tokens`` units of ``unit_tokens`` tokens (a partial
last block into its whole units only). Output tokens are unique to their request. Payload bytes
are accounted, not written: a real trace holds hundreds of GB of units.

Reported per policy: ``token_hit_rate`` (prompt tokens served from cache / prompt tokens),
``upper_bound_hit_rate`` (infinite capacity, every unit seen before hits), bytes written and read,
evictions, and with a RAM tier the share of hit tokens it served.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cachedir.admission import make_admission
from cachedir.index import CapacityIndex

__all__ = ["TraceRequest", "TraceResult", "read_trace", "replay", "unique_unit_count"]

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class TraceResult:
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    upper_bound_hit_tokens: int
    ram_hit_tokens: int
    bytes_written: int
    bytes_read: int
    evictions: int
    capacity_bytes: int | None

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": round(self.hit_tokens / max(1, self.prompt_tokens), 6),
            "upper_bound_hit_rate": round(self.upper_bound_hit_tokens / max(1, self.prompt_tokens), 6),
            "ram_hit_tokens": self.ram_hit_tokens,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "evictions": self.evictions,
            "capacity_bytes": self.capacity_bytes,
        }


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """Parse a Mooncake-format JSONL file; a malformed line raises ValueError naming it."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and n > limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(float(obj["timestamp"]), int(obj["input_length"]),
                                   int(obj["output_length"]), tuple(int(h) for h in obj["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
            if req.input_length < 0 or req.output_length < 0:
                raise ValueError(f"{path}:{n}: negative length")
            yield req


def _prompt_keys(req: TraceRequest, unit_tokens: int) -> list[bytes]:
    keys = []
    for b, block in enumerate(req.hash_ids):
        tokens_in_block = min(BLOCK_TOKENS, req.input_length - b * BLOCK_TOKENS)
        for j in range(max(0, tokens_in_block) // unit_tokens):
            keys.append(struct.pack("<QII", block, j, 0))
        if tokens_in_block < BLOCK_TOKENS:
            break
    assert len(keys) <= req.input_length // unit_tokens, (len(keys), req.input_length)
    return keys


def _output_keys(req_idx: int, req: TraceRequest, num_prompt_units: int, unit_tokens: int) -> list[bytes]:
    total_units = (req.input_length + req.output_length) // unit_tokens
    return [struct.pack("<QII", req_idx, j, 1) for j in range(total_units - num_prompt_units)]


def unique_unit_count(requests: Iterable[TraceRequest], unit_tokens: int = 64) -> int:
    """Distinct units the trace writes (prompt and output) — the size of an unbounded cache."""
    seen: set[bytes] = set()
    for i, req in enumerate(requests):
        keys = _prompt_keys(req, unit_tokens)
        seen.update(keys)
        seen.update(_output_keys(i, req, len(keys), unit_tokens))
    return len(seen)


def replay(
    requests: Iterable[TraceRequest],
    policy: str = "all",
    capacity_bytes: int | None = None,
    unit_bytes: int = 327_680,
    unit_tokens: int = 64,
    ram_bytes: int | None = None,
    eviction: str = "lru",
    deepseek_every_units: int = 64,
) -> TraceResult:
    if BLOCK_TOKENS % unit_tokens:
        raise ValueError(f"unit size {unit_tokens} must divide the trace's {BLOCK_TOKENS}-token blocks")
    admission = make_admission(policy, deepseek_every_units)
    cap = capacity_bytes if capacity_bytes is not None else 1 << 62
    ssd = CapacityIndex(cap, eviction)
    ram = CapacityIndex(ram_bytes, "lru") if ram_bytes else None
    seen: set[bytes] = set()
    res = TraceResult(policy, 0, 0, 0, 0, 0, 0, 0, 0, capacity_bytes)

    def admit_units(keys: list[bytes], idx: list[int], now: float) -> None:
        for i in idx:
            k = keys[i]
            if k not in ssd:
                if ssd.add(k, unit_bytes, now) or k in ssd:
                    res.bytes_written += unit_bytes
            else:
                ssd.touch(k, now)
            if ram is not None:
                ram.add(k, unit_bytes, now)

    def admit_prefixes(keys: list[bytes], boundaries: list[int], now: float) -> None:
        for b in boundaries:  # a whole prefix is one item, bytes included again
            entry = b"P" + keys[b - 1]
            if entry not in ssd:
                ssd.add(entry, b * unit_bytes, now)
                if entry in ssd:
                    res.bytes_written += b * unit_bytes
            else:
                ssd.touch(entry, now)

    for idx, req in enumerate(requests):
        now = req.timestamp_ms / 1000.0
        keys = _prompt_keys(req, unit_tokens)
        res.requests += 1
        res.prompt_tokens += req.input_length
        # upper bound: unit granularity, infinite capacity
        bound = 0
        while bound < len(keys) and keys[bound] in seen:
            bound += 1
        res.upper_bound_hit_tokens += bound * unit_tokens
        # lookup
        ssd.expire(now)
        if admission.whole_prefixes:
            hit = 0
            for b in range(len(keys), 0, -1):
                entry = b"P" + keys[b - 1]
                if entry in ssd:
                    ssd.touch(entry, now)
                    hit = b
                    break
            ram_hit = 0
        else:
            hit = 0
            while hit < len(keys) and keys[hit] in ssd:
                hit += 1
            ram_hit = 0
            for k in keys[:hit]:
                ssd.touch(k, now)
                if ram is not None:
                    if k in ram:
                        ram_hit += 1
                        ram.touch(k, now)
                    else:
                        ram.add(k, unit_bytes, now)  # promoted on hit
        res.hit_tokens += hit * unit_tokens
        res.ram_hit_tokens += ram_hit * unit_tokens
        res.bytes_read += (hit - ram_hit) * unit_bytes
        # persistence at the end of the input, then of the output
        a = admission.on_input_end(keys)
        admit_units(keys, a.units, now) if not admission.whole_prefixes else admit_prefixes(keys, a.prefixes, now)
        all_keys = keys + _output_keys(idx, req, len(keys), unit_tokens)
        a = admission.on_output_end(all_keys, len(keys))
        if admission.whole_prefixes:
            admit_prefixes(all_keys, a.prefixes, now)
        else:
            admit_units(all_keys, a.units, now)
        seen.update(all_keys)
    res.evictions = ssd.evictions
    return res
