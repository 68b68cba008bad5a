"""A replica's memory bound: the most its configuration lets it hold, whatever requests it accepts.

A replica holds its weights and its KV pool (both fixed at start), its cache's RAM tier and read
buffers (fixed caps), compiled grammars (the grammar cache's cap), and per pass what the engine's
caps allow: a scored prompt chunk's logits and their log-softmax (``scored_logits_mib``) and a
step's logits with the copies sampling makes of them (one row per sequence and draft). The rest
of a request (its tokens, its grammar's place, its outputs) is bounded by the ingress's cost
budget and is small beside these. The process itself (Python, torch, xgrammar, Ray's worker)
takes a measured allowance. ``tide bench neighbour`` compares the replicas' peak resident memory
under the hostile requests with this bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from cluster.engine_config import EngineConfig

__all__ = ["RUNTIME_MB", "MemoryBound", "memory_bound", "resident_mb", "tensor_bytes"]

MIB = 1 << 20
# A CPU replica's resident memory before its model, pool and caches: the interpreter, torch,
# xgrammar, the CPU kernels and Ray's worker (about 700-900 MB measured here), with headroom.
RUNTIME_MB = 1024.0
# float32 [rows, V] tensors a step makes of its logits at once: the logits, the held-stops,
# biased, penalized and masked copies, and the sampler's probabilities
STEP_LOGIT_COPIES = 6


@dataclass(frozen=True, slots=True)
class MemoryBound:
    """The parts of a replica's bound, in MiB."""

    weights_mb: float
    kv_pool_mb: float
    cache_mb: float  # the cache's RAM tier and read buffers
    grammar_cache_mb: float
    scored_logits_mb: float
    step_logits_mb: float
    runtime_mb: float

    @property
    def total_mb(self) -> float:
        return sum(asdict(self).values())

    def to_dict(self) -> dict[str, float]:
        return {**{k: round(v, 1) for k, v in asdict(self).items()}, "total_mb": round(self.total_mb, 1)}


def memory_bound(weights_bytes: int, pool_bytes: int, vocab_size: int, cfg: EngineConfig, cache_bytes: int = 0,
                 grammar_cache_bytes: int = 256 * MIB, runtime_mb: float = RUNTIME_MB) -> MemoryBound:
    """The bound of a replica whose model holds ``weights_bytes`` and pool ``pool_bytes``, with
    ``vocab_size`` logits per row, the engine's caps ``cfg``, a cache holding at most
    ``cache_bytes`` in memory, and a grammar cache of at most ``grammar_cache_bytes``."""
    rows = cfg.max_num_seqs * (1 + cfg.speculative_tokens)
    return MemoryBound(
        weights_mb=weights_bytes / MIB,
        kv_pool_mb=pool_bytes / MIB,
        cache_mb=cache_bytes / MIB,
        grammar_cache_mb=grammar_cache_bytes / MIB,
        scored_logits_mb=float(cfg.scored_logits_mib),
        step_logits_mb=rows * vocab_size * 4 * STEP_LOGIT_COPIES / MIB,
        runtime_mb=runtime_mb,
    )


def resident_mb() -> dict[str, float]:
    """This process's resident memory now and at its peak, in MiB (Linux's /proc; {} elsewhere)."""
    names = {"VmRSS:": "rss_mb", "VmHWM:": "peak_rss_mb"}
    try:
        with open("/proc/self/status") as f:
            fields = [line.split() for line in f]
    except OSError:  # not Linux: no figures
        return {}
    return {names[x[0]]: round(int(x[1]) / 1024, 1) for x in fields if x and x[0] in names}


def tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensors reachable from ``root`` through attributes, lists, tuples
    and dicts (a model of any family: its weights, quantized ones with their scales, its tables)."""
    seen_objects: set[int] = set()
    seen_storage: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or obj is None or isinstance(obj, str | bytes | int | float | bool | torch.dtype):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.untyped_storage().data_ptr() not in seen_storage:
                seen_storage.add(obj.untyped_storage().data_ptr())
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.state_dict(keep_vars=True).values())
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else
                         [getattr(obj, n) for n in obj.__slots__ if hasattr(obj, n)])
    return total
