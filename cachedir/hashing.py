"""Unit keys: a chained content hash over 64-token cache units, seeded by a namespace.

A prompt is cut into units of ``unit_size`` tokens from token 0; a partial tail is not a unit.
``key_i = xxh3_128(key_{i-1} || token_ids_i as little-endian u32)`` and ``key_{-1}`` is the
namespace seed, itself a hash of the model fingerprint (architecture, weights revision, KV dtype
and layout, unit size) and the tenant salt. Equal keys therefore mean: same model, same tenant,
same tokens from position 0 up to the end of the unit. Keys are 16 raw bytes; ``hex`` round-trips.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import xxhash

__all__ = ["Namespace", "UnitKey", "chain_keys", "num_units"]

UnitKey = bytes  # 16 bytes
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a cache unit's bytes depend on besides its tokens."""

    model_fingerprint: str  # architecture config digest
    weights_revision: str  # checkpoint digest or revision id
    kv_dtype: str  # e.g. "float32", "bfloat16"
    kv_layout: str  # e.g. "mla-latent:512+64"
    unit_size: int = 64
    tenant_salt: str = ""
    seed: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.unit_size <= 0:
            raise ValueError(f"unit_size must be > 0, got {self.unit_size}")
        blob = json.dumps(
            [self.model_fingerprint, self.weights_revision, self.kv_dtype, self.kv_layout,
             self.unit_size, self.tenant_salt],
        ).encode()
        object.__setattr__(self, "seed", xxhash.xxh3_128_digest(b"tideserve-ns-v1\0" + blob))

    @property
    def id(self) -> str:
        """Short printable namespace id (used to prefix directory keys)."""
        return self.seed[:8].hex()

    def for_tenant(self, salt: str) -> Namespace:
        return Namespace(self.model_fingerprint, self.weights_revision, self.kv_dtype,
                         self.kv_layout, self.unit_size, salt)


def num_units(num_tokens: int, unit_size: int) -> int:
    return num_tokens // unit_size


def chain_keys(seed: bytes, token_ids, unit_size: int, max_units: int | None = None,
               parent: bytes | None = None) -> list[UnitKey]:
    """Keys of the whole units of ``token_ids`` (a sequence of ints or an int array).
    ``parent``: the key of the unit just before ``token_ids`` (the chain goes on from it);
    None: ``token_ids`` start at token 0 and the chain from ``seed``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in u32")
    n = ids.size // unit_size
    if max_units is not None:
        n = min(n, max_units)
    raw = ids[: n * unit_size].astype("<u4").tobytes()
    step = unit_size * 4
    keys = []
    parent = seed if parent is None else parent
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + raw[i * step : (i + 1) * step])
        keys.append(parent)
    return keys
