"""Unit keys: a chained, keyed content hash over 64-token cache units, seeded by a namespace.

A prompt is cut into units of ``unit_size`` tokens from token 0; a partial tail is not a unit.
``key_i = BLAKE2b-128[key=seed](key_{i-1} || token_ids_i as little-endian u32)`` and
``key_{-1}`` is the namespace seed, itself a hash of the model fingerprint (architecture,
weights revision, KV dtype and layout, unit size) and the tenant salt, keyed by the cluster's
cache secret when it has one. Equal keys therefore mean: same model, same tenant, same tokens
from position 0 up to the end of the unit. The hash is collision resistant (a crafted collision
would serve one prompt's KV for another): 2^64 work without the secret, out of reach with it,
since a client then cannot compute keys at all. Keys are 16 raw bytes; ``hex`` round-trips.

The secret also gives each namespace its unit MAC key (``Namespace.mac_key``, see
``cachedir.unitfile``), held by the serving replicas and never by cache agents.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Namespace", "RESUME_TOKEN", "UnitKey", "chain_hash", "chain_keys", "num_units", "read_secret", "resume_key",
           "unit_mac_key"]

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
    secret: bytes = field(default=b"", repr=False)  # the cluster's cache secret (empty: none)
    seed: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.unit_size <= 0:
            raise ValueError(f"unit_size must be > 0, got {self.unit_size}")
        blob = json.dumps(
            [self.model_fingerprint, self.weights_revision, self.kv_dtype, self.kv_layout,
             self.unit_size, self.tenant_salt],
        ).encode()
        seed = hashlib.blake2b(b"tideserve-ns-v2\0" + blob, digest_size=KEY_BYTES, key=self.secret).digest()
        object.__setattr__(self, "seed", seed)

    @property
    def mac_key(self) -> bytes | None:
        """The key this namespace's units are authenticated under; None without a secret."""
        return unit_mac_key(self.secret, self.seed)

    @property
    def id(self) -> str:
        """Short printable namespace id (used to prefix directory keys)."""
        return self.seed[:8].hex()

    def for_tenant(self, salt: str) -> Namespace:
        return Namespace(self.model_fingerprint, self.weights_revision, self.kv_dtype,
                         self.kv_layout, self.unit_size, salt, self.secret)


def read_secret(path: str | None, what: str = "cache secret") -> bytes:
    """The secret in the file ``path`` (b"" for None); ``ValueError`` naming the file when it is
    missing, short, or open to every user (group read is allowed: Kubernetes adds it to Secret
    volumes under an fsGroup). ``what`` names the secret in errors."""
    if not path:
        return b""
    p = Path(path)
    try:
        st = p.stat()
        value = p.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"{what} file {path}: {e.strerror or e}") from None
    if st.st_mode & 0o007:
        raise ValueError(f"{what} file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    if len(value) < 16:
        raise ValueError(f"{what} file {path} holds {len(value)} bytes; give it at least 16")
    return value


def unit_mac_key(secret: bytes, seed: bytes) -> bytes | None:
    """The MAC key of the namespace ``seed`` under the cluster's cache ``secret`` (None without one)."""
    if not secret:
        return None
    return hashlib.blake2b(seed, digest_size=32, key=secret, person=b"tide-unit-mac").digest()


def chain_hash(seed: bytes, parent: bytes, tokens_raw: bytes) -> UnitKey:
    """The key of the unit with ``tokens_raw`` (little-endian u32) after the unit ``parent``."""
    return hashlib.blake2b(parent + tokens_raw, digest_size=KEY_BYTES, key=seed).digest()


# The one "token" of a resume record: the state a model needs to go on after a unit, beyond the
# unit itself (a chain of one sentinel token after the unit; no vocabulary has this id, and no
# unit of 64 tokens hashes to the same key)
RESUME_TOKEN = 0xFFFFFFFF


def resume_key(seed: bytes, unit_key: UnitKey) -> UnitKey:
    """The key of the resume record that follows the unit ``unit_key``."""
    return chain_hash(seed, unit_key, RESUME_TOKEN.to_bytes(4, "little"))


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
        parent = chain_hash(seed, parent, raw[i * step : (i + 1) * step])
        keys.append(parent)
    return keys
