"""The unit file format: one self-describing, checksummed, sealed file per cache unit.

Layout (little-endian)::

    magic      8s   b"TIDEUNIT"
    version    u16  3
    dtype      u8   code (see DTYPES)
    flags      u8   bit 0 SEALED: the token ids are withheld (zeros) and the payload encrypted
    header_len u32  bytes from the start to the payload
    namespace  16s  Namespace.seed
    key        16s  this unit's chain key
    parent     16s  previous unit's key (the namespace seed for unit 0)
    num_tokens u32
    num_layers u32
    dim        u32  values per token per layer
    payload_len u64
    checksum   u64  xxh3_64 of the payload as stored
    mac        32s  a SEALED unit's AES-GCM nonce (12 bytes) and tag (16), then 4 zero bytes;
                    all zeros when written without a key
    tokens     num_tokens x u32 (zeros when SEALED)
    payload    [num_layers, num_tokens, dim] values of ``dtype`` (encrypted when SEALED)

``decode`` verifies every field against what the reader expects; any mismatch raises
``UnitCorrupt`` and the caller treats it as a miss. Wrong KV is never returned. The checksum
catches a damaged file and needs no secret (stores and agents check it).

A unit written with its namespace's key is SEALED: AES-256-GCM encrypts the payload under a
random nonce, with every other header byte as associated data, and the header carries no token
ids. The files and the agents that store and relay them hold neither a tenant's prompt nor KV
from which it could be recovered. The tag proves that a holder of the key wrote the unit, so a
reader with the key (the serving replicas) rejects a self-consistent unit forged by whoever can
push to or serve from a cache agent; it knows the tokens it asks for and checks that the key is
their chain hash (as it does for every unit). AES-GCM runs at several GB/s a core (AES-NI,
VAES): opening a unit costs less than reading it. Without the tokens and the key (a store, an
agent) the checksum is all there is to check.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cachedir.hashing import chain_hash

__all__ = ["DTYPES", "NO_MAC", "PayloadOpener", "UnitCorrupt", "UnitHeader", "check_header", "decode", "encode",
           "encode_parts", "holds", "open_sealed", "read_header", "seal"]

MAGIC = b"TIDEUNIT"
VERSION = 3
_FIXED = struct.Struct("<8sHBBI16s16s16sIIIQQ32s")
_MAC_AT = _FIXED.size - 32  # offset of the mac field
NO_MAC = bytes(32)
NONCE, TAG = 12, 16  # a sealed unit's mac field: nonce, tag, zeros
SEALED = 1
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
    mac: bytes = NO_MAC
    sealed: bool = False  # token_ids are zeros (withheld), see the module docstring

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def _aad(header: bytes | memoryview) -> bytes:
    """A header's bytes but its mac field: what a seal authenticates besides the payload."""
    return bytes(header[:_MAC_AT]) + bytes(header[_FIXED.size :])


def seal(key: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> tuple[bytes, memoryview]:
    """(the mac field, the encrypted payload): AES-256-GCM of ``payload`` under ``key`` and a
    random nonce, with ``header`` (its mac field aside) as associated data."""
    nonce = os.urandom(NONCE)
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(_aad(header))
    out = bytearray(len(payload) + 15)
    n = enc.update_into(payload, out)
    enc.finalize()
    return nonce + enc.tag + bytes(_FIXED.size - _MAC_AT - NONCE - TAG), memoryview(out)[:n]


def open_sealed(key: bytes, header: bytes | memoryview, mac: bytes, payload: bytes | memoryview,
                out: memoryview | bytearray | None = None) -> memoryview:
    """The plaintext of a sealed payload (into ``out`` when given: at least 15 bytes longer);
    ``UnitCorrupt`` when the tag does not match (another key, or anything changed)."""
    dec = Cipher(algorithms.AES(key), modes.GCM(mac[:NONCE], mac[NONCE : NONCE + TAG])).decryptor()
    dec.authenticate_additional_data(_aad(header))
    out = bytearray(len(payload) + 15) if out is None else out
    n = dec.update_into(payload, out)
    try:
        dec.finalize()
    except InvalidTag:
        raise UnitCorrupt("MAC mismatch: the unit was not sealed by a holder of this cluster's key") from None
    return memoryview(out)[:n]


def encode(
    namespace: bytes, key: bytes, parent: bytes, token_ids, payload: bytes, num_layers: int,
    dim: int, dtype: str, mac_key: bytes | None = None, mac: bytes = NO_MAC, sealed: bool = False,
) -> bytes:
    """Header + payload as one bytes object. ``payload`` is the raw [L, T, D] array bytes."""
    header, payload = encode_parts(namespace, key, parent, token_ids, payload, num_layers, dim, dtype, mac_key, mac,
                                   sealed)
    return header + payload


def encode_parts(
    namespace: bytes, key: bytes, parent: bytes, token_ids, payload: bytes, num_layers: int,
    dim: int, dtype: str, mac_key: bytes | None = None, mac: bytes = NO_MAC, sealed: bool = False,
) -> tuple[bytes, bytes]:
    """The header (fixed fields and token ids) and the payload, to be written one after the other
    (no copy of an unsealed payload). ``mac_key``: seal the unit (see the module docstring);
    without one the header carries ``mac`` and ``sealed`` (a store re-encoding a unit keeps both,
    and its payload as stored)."""
    sealed = sealed or mac_key is not None
    tokens = np.asarray(token_ids, dtype="<u4")
    if sealed:
        tokens = np.zeros(len(tokens), dtype="<u4")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported unit dtype {dtype!r}; supported: {sorted(DTYPE_CODES)}")
    expected = num_layers * len(tokens) * dim * ITEMSIZE[dtype]
    if len(payload) != expected:
        raise ValueError(f"payload of {len(payload)} bytes, expected {expected} for [{num_layers}, {len(tokens)}, {dim}] {dtype}")
    header_len = _FIXED.size + tokens.nbytes

    def header_with(mac: bytes, checksum: int) -> bytes:
        return _FIXED.pack(MAGIC, VERSION, DTYPE_CODES[dtype], SEALED if sealed else 0, header_len, namespace, key,
                           parent, len(tokens), num_layers, dim, len(payload), checksum, mac) + tokens.tobytes()

    if mac_key is None:
        return header_with(mac, xxhash.xxh3_64_intdigest(payload)), payload
    # the checksum (of the stored, encrypted bytes) is known after sealing: the seal leaves it out
    mac, stored = seal(mac_key, header_with(NO_MAC, 0), payload)
    return header_with(mac, xxhash.xxh3_64_intdigest(stored)), stored


def read_header(buf: bytes | memoryview) -> UnitHeader:
    """Parse and sanity-check the header at the start of ``buf``."""
    if len(buf) < _FIXED.size:
        raise UnitCorrupt(f"truncated header ({len(buf)} bytes)")
    (magic, version, dtype_code, flags, header_len, ns, key, parent, n_tok, n_layers, dim,
     payload_len, checksum, mac) = _FIXED.unpack_from(buf, 0)
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
    if flags & ~SEALED:
        raise UnitCorrupt(f"unknown header flags {flags:#x}")
    return UnitHeader(ns, key, parent, tokens, n_layers, dim, dtype, payload_len, checksum, header_len, mac,
                      bool(flags & SEALED))


def _raw(token_ids) -> bytes:
    return np.asarray(token_ids, dtype="<u4").tobytes()


def holds(h: UnitHeader, namespace: bytes, key: bytes, token_ids) -> bool:
    """Whether the unit of header ``h`` is ``key`` of ``namespace`` over ``token_ids``: the
    stored ids are compared when there are some, and the key must be their chain hash."""
    tokens = tuple(int(t) for t in token_ids)
    if h.namespace != namespace or h.key != key or len(tokens) != len(h.token_ids):
        return False
    if not h.sealed and tokens != h.token_ids:
        return False
    return chain_hash(namespace, h.parent, _raw(tokens)) == key


def check_header(
    buf: bytes | memoryview, namespace: bytes, key: bytes, token_ids=None, mac_key: bytes | None = None,
) -> UnitHeader:
    """The header at the start of ``buf`` verified as the unit ``key`` of ``namespace`` (and,
    when given, ``token_ids``; with ``mac_key``, a sealed one): what ``decode`` checks before
    the payload. ``buf`` may end after the token ids."""
    h = read_header(buf)
    if h.namespace != namespace:
        raise UnitCorrupt("namespace mismatch")
    if h.key != key:
        raise UnitCorrupt("key mismatch")
    if token_ids is not None:
        tokens = tuple(int(t) for t in token_ids)
        if len(tokens) != len(h.token_ids) or (not h.sealed and tokens != h.token_ids):
            raise UnitCorrupt("token ids mismatch")
        if chain_hash(namespace, h.parent, _raw(tokens)) != key:
            raise UnitCorrupt("key is not the chain hash of parent and tokens")
        h = dataclasses.replace(h, token_ids=tokens)  # a sealed unit's reader knows its tokens
    # without the reader's tokens a sealed unit has no ids to check: the checksum (and MAC) below
    elif not h.sealed and chain_hash(namespace, h.parent, bytes(memoryview(buf)[_FIXED.size : h.header_len])) != key:
        raise UnitCorrupt("key is not the chain hash of parent and tokens")
    if mac_key is not None and not h.sealed:
        raise UnitCorrupt("MAC mismatch: the unit is not sealed, and this cluster seals its units")
    return h


def decode(
    buf: bytes | memoryview, namespace: bytes, key: bytes, token_ids=None, mac_key: bytes | None = None,
    out: bytearray | memoryview | None = None,
) -> tuple[UnitHeader, memoryview]:
    """Verify ``buf`` as the unit ``key`` of ``namespace`` (and, when given, ``token_ids``, and
    that a holder of ``mac_key`` sealed it); returns the header and a view of the payload: with
    ``mac_key`` the plaintext (in ``out`` when given, at least 15 bytes longer than it), else
    the payload as stored."""
    h = check_header(buf, namespace, key, token_ids, mac_key)
    if len(buf) != h.file_len:
        raise UnitCorrupt(f"file is {len(buf)} bytes, header says {h.file_len}")
    payload = memoryview(buf)[h.header_len :]
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise UnitCorrupt("payload checksum mismatch")
    if mac_key is None:
        return h, payload
    return h, open_sealed(mac_key, _sealed_header(buf, h), h.mac, payload, out)


def _sealed_header(buf: bytes | memoryview, h: UnitHeader) -> bytes:
    """The header as sealed: the checksum is of the stored bytes, so the seal covers the header
    without it."""
    return _FIXED.pack(*_FIXED.unpack_from(buf, 0)[:12], 0, NO_MAC) + bytes(memoryview(buf)[_FIXED.size : h.header_len])


class PayloadOpener:
    """A unit's payload verified piece by piece, in order, as it is read: each piece's plaintext
    comes at once (into ``out``, for a sealed unit); whether the whole was the unit's (its
    checksum and, sealed, its seal) is known only at the end (``verified``). Plaintext handed
    out before then must not be trusted until it says so."""

    def __init__(self, header: bytes | memoryview, h: UnitHeader, mac_key: bytes | None) -> None:
        self._hash = xxhash.xxh3_64()
        self._checksum, self._fed, self._size = h.checksum, 0, h.payload_len
        self._dec = None
        if mac_key is not None:
            mac = h.mac
            self._dec = Cipher(algorithms.AES(mac_key), modes.GCM(mac[:NONCE], mac[NONCE : NONCE + TAG])).decryptor()
            self._dec.authenticate_additional_data(_aad(_sealed_header(header, h)))

    def feed(self, stored: memoryview, out: memoryview) -> memoryview:
        """The plaintext of the next piece ``stored``: ``stored`` itself, or decrypted into ``out``
        (at least 15 bytes longer than it)."""
        self._hash.update(stored)
        self._fed += len(stored)
        if self._dec is None:
            return stored
        n = self._dec.update_into(stored, out)
        return out[:n]

    def verified(self) -> bool:
        """After the last piece: the checksum, and the seal, hold."""
        if self._fed != self._size or self._hash.intdigest() != self._checksum:
            return False
        if self._dec is None:
            return True
        try:
            self._dec.finalize()
        except InvalidTag:
            return False
        return True