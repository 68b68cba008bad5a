"""The unit file format: one self-describing, checksummed file per cache unit.

Layout (little-endian)::

    magic      8s   b"TIDEUNIT"
    version    u16  1
    dtype      u8   code (see DTYPES)
    reserved   u8
    header_len u32  bytes from the start to the payload
    namespace  16s  Namespace.seed
    key        16s  this unit's chain key
    parent     16s  previous unit's key (the namespace seed for unit 0)
    num_tokens u32
    num_layers u32
    dim        u32  values per token per layer
    payload_len u64
    checksum   u64  xxh3_64 of the payload
    tokens     num_tokens x u32
    payload    [num_layers, num_tokens, dim] values of ``dtype``

``decode`` verifies every field against what the reader expects; any mismatch raises
``UnitCorrupt`` and the caller treats it as a miss. Wrong KV is never returned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

__all__ = ["DTYPES", "UnitCorrupt", "UnitHeader", "decode", "encode", "encode_parts", "read_header"]

MAGIC = b"TIDEUNIT"
VERSION = 1
_FIXED = struct.Struct("<8sHBBI16s16s16sIIIQQ")
DTYPES = {1: "float32", 2: "bfloat16", 3: "float16"}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class UnitCorrupt(ValueError):
    """A unit file that fails verification (treated as a cache miss)."""


@dataclass(frozen=True, slots=True)
class UnitHeader:
    namespace: bytes
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    num_layers: int
    dim: int
    dtype: str
    payload_len: int
    checksum: int
    header_len: int

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def encode(
    namespace: bytes, key: bytes, parent: bytes, token_ids, payload: bytes, num_layers: int,
    dim: int, dtype: str,
) -> bytes:
    """Header + payload as one bytes object. ``payload`` is the raw [L, T, D] array bytes."""
    header, payload = encode_parts(namespace, key, parent, token_ids, payload, num_layers, dim, dtype)
    return header + payload


def encode_parts(
    namespace: bytes, key: bytes, parent: bytes, token_ids, payload: bytes, num_layers: int,
    dim: int, dtype: str,
) -> tuple[bytes, bytes]:
    """The header (fixed fields and token ids) and the payload, to be written one after the other
    (no copy of the payload)."""
    tokens = np.asarray(token_ids, dtype="<u4")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported unit dtype {dtype!r}; supported: {sorted(DTYPE_CODES)}")
    expected = num_layers * len(tokens) * dim * ITEMSIZE[dtype]
    if len(payload) != expected:
        raise ValueError(f"payload of {len(payload)} bytes, expected {expected} for [{num_layers}, {len(tokens)}, {dim}] {dtype}")
    header_len = _FIXED.size + tokens.nbytes
    fixed = _FIXED.pack(
        MAGIC, VERSION, DTYPE_CODES[dtype], 0, header_len, namespace, key, parent, len(tokens),
        num_layers, dim, len(payload), xxhash.xxh3_64_intdigest(payload),
    )
    return fixed + tokens.tobytes(), payload


def read_header(buf: bytes | memoryview) -> UnitHeader:
    """Parse and sanity-check the header at the start of ``buf``."""
    if len(buf) < _FIXED.size:
        raise UnitCorrupt(f"truncated header ({len(buf)} bytes)")
    (magic, version, dtype_code, _, header_len, ns, key, parent, n_tok, n_layers, dim,
     payload_len, checksum) = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise UnitCorrupt("bad magic")
    if version != VERSION:
        raise UnitCorrupt(f"unsupported unit format version {version}")
    if dtype_code not in DTYPES:
        raise UnitCorrupt(f"unknown dtype code {dtype_code}")
    if header_len != _FIXED.size + 4 * n_tok:
        raise UnitCorrupt("inconsistent header length")
    dtype = DTYPES[dtype_code]
    if payload_len != n_layers * n_tok * dim * ITEMSIZE[dtype]:
        raise UnitCorrupt("payload length does not match its shape")
    if len(buf) < header_len:
        raise UnitCorrupt("truncated token ids")
    tokens = tuple(np.frombuffer(buf, dtype="<u4", count=n_tok, offset=_FIXED.size).tolist())
    return UnitHeader(ns, key, parent, tokens, n_layers, dim, dtype, payload_len, checksum, header_len)


def decode(
    buf: bytes | memoryview, namespace: bytes, key: bytes, token_ids=None
) -> tuple[UnitHeader, memoryview]:
    """Verify ``buf`` as the unit ``key`` of ``namespace`` (and, when given, ``token_ids``);
    returns the header and a view of the payload."""
    h = read_header(buf)
    if h.namespace != namespace:
        raise UnitCorrupt("namespace mismatch")
    if h.key != key:
        raise UnitCorrupt("key mismatch")
    if token_ids is not None and tuple(int(t) for t in token_ids) != h.token_ids:
        raise UnitCorrupt("token ids mismatch")
    tokens_raw = bytes(memoryview(buf)[_FIXED.size : h.header_len])
    if xxhash.xxh3_128_digest(h.parent + tokens_raw) != key:
        raise UnitCorrupt("key is not the chain hash of parent and tokens")
    if len(buf) != h.file_len:
        raise UnitCorrupt(f"file is {len(buf)} bytes, header says {h.file_len}")
    payload = memoryview(buf)[h.header_len :]
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise UnitCorrupt("payload checksum mismatch")
    return h, payload
