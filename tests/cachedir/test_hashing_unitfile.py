from __future__ import annotations

import subprocess
import sys

import pytest

from cachedir.hashing import Namespace, chain_keys
from cachedir.unitfile import UnitCorrupt, decode
from tests.cachedir.units import NS, make_units


def test_keys_chain_whole_units_only():
    toks = list(range(200))
    keys = chain_keys(NS.seed, toks, 64)
    assert len(keys) == 3  # 200 tokens -> 3 whole units, the tail is not a unit
    assert keys == chain_keys(NS.seed, toks[:192], 64)
    other = toks.copy()
    other[5] = 9999  # a change in unit 0 changes every later key
    assert all(a != b for a, b in zip(keys, chain_keys(NS.seed, other, 64), strict=True))
    other = toks.copy()
    other[130] = 9999  # a change in unit 2 keeps units 0 and 1
    assert chain_keys(NS.seed, other, 64)[:2] == keys[:2]
    assert bytes.fromhex(keys[0].hex()) == keys[0]


def test_namespace_isolates_models_checkpoints_and_tenants():
    toks = list(range(64))
    base = chain_keys(NS.seed, toks, 64)
    for ns in (Namespace("fp-other", "rev1", "float32", NS.kv_layout),
               Namespace(NS.model_fingerprint, "rev2", "float32", NS.kv_layout),
               Namespace(NS.model_fingerprint, "rev1", "bfloat16", NS.kv_layout),
               NS.for_tenant("acme")):
        assert chain_keys(ns.seed, toks, 64) != base


def test_keys_are_the_same_in_another_process():
    toks = list(range(1000, 1300))
    code = (
        "from cachedir.hashing import chain_keys; from tests.cachedir.units import NS;"
        "print(','.join(k.hex() for k in chain_keys(NS.seed, list(range(1000, 1300)), 64)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".")
    assert out.stdout.strip() == ",".join(k.hex() for k in chain_keys(NS.seed, toks, 64))


def test_bad_tokens_rejected():
    with pytest.raises(ValueError, match="u32"):
        chain_keys(NS.seed, [-1] * 64, 64)


def test_unit_file_round_trip_and_every_corruption_is_detected():
    unit = make_units(list(range(128)))[1]
    data = unit.encode()
    h, payload = decode(data, unit.namespace, unit.key, unit.token_ids)
    assert bytes(payload) == unit.payload and h.parent == unit.parent
    flipped = bytearray(data)
    flipped[-100] ^= 0x04
    cases = {
        "checksum": bytes(flipped),
        "truncated": data[:-10],
        "header": data[:30],
        "magic": b"X" + data[1:],
    }
    for bad in cases.values():
        with pytest.raises(UnitCorrupt):
            decode(bad, unit.namespace, unit.key)
    with pytest.raises(UnitCorrupt, match="token ids"):
        decode(data, unit.namespace, unit.key, tuple(range(64)))
    with pytest.raises(UnitCorrupt, match="namespace"):
        decode(data, NS.for_tenant("x").seed, unit.key)
    with pytest.raises(UnitCorrupt, match="key mismatch"):
        decode(data, unit.namespace, b"\0" * 16)


def test_a_chain_goes_on_from_a_parent_key_as_if_hashed_from_token_0():
    ids = list(range(64 * 5 + 3))
    whole = chain_keys(b"seed", ids, 64)
    head = chain_keys(b"seed", ids[: 64 * 2], 64)
    assert head + chain_keys(b"seed", ids[64 * 2 :], 64, parent=head[-1]) == whole


SECRET_NS = Namespace(NS.model_fingerprint, NS.weights_revision, NS.kv_dtype, NS.kv_layout, 64, secret=b"s" * 32)


def test_the_cache_secret_keys_the_hash_and_never_shows():
    toks = list(range(128))
    other = Namespace(NS.model_fingerprint, NS.weights_revision, NS.kv_dtype, NS.kv_layout, 64, secret=b"t" * 32)
    assert len({chain_keys(ns.seed, toks, 64)[0] for ns in (NS, SECRET_NS, other)}) == 3
    assert SECRET_NS.for_tenant("acme").secret == SECRET_NS.secret
    assert SECRET_NS.for_tenant("acme").mac_key not in (None, SECRET_NS.mac_key)  # one MAC key per tenant
    assert NS.mac_key is None and "sss" not in repr(SECRET_NS)


def _forge(unit, payload: bytes) -> bytes:
    """A self-consistent unit with another payload: right namespace, key, parent, tokens and
    checksum, as anyone who can read the unit files (or holds the agent token) can make."""
    from cachedir.unitfile import encode

    return encode(unit.namespace, unit.key, unit.parent, unit.token_ids, payload, unit.num_layers, unit.dim, unit.dtype)


def test_a_mac_proves_who_wrote_the_unit():
    unit = make_units(list(range(64)), SECRET_NS)[0]
    good = unit.encode(SECRET_NS.mac_key)
    h, payload = decode(good, unit.namespace, unit.key, unit.token_ids, mac_key=SECRET_NS.mac_key)
    assert bytes(payload) == bytes(unit.payload) and h.mac != bytes(32)
    decode(good, unit.namespace, unit.key, unit.token_ids)  # a store without the key checks damage only
    forged = _forge(unit, bytes(len(unit.payload)))  # zero KV
    decode(forged, unit.namespace, unit.key, unit.token_ids)  # self-consistent: passes every other check
    for bad in (forged, unit.encode(), unit.encode(SECRET_NS.for_tenant("x").mac_key)):
        with pytest.raises(UnitCorrupt, match="MAC mismatch"):
            decode(bad, unit.namespace, unit.key, unit.token_ids, mac_key=SECRET_NS.mac_key)
    # the MAC covers the header too: the same payload under a changed field fails
    from cachedir.unitfile import _FIXED

    tampered = bytearray(good)
    tampered[_FIXED.size] ^= 1  # a withheld token id of a sealed unit: no other check reads it
    decode(bytes(tampered), unit.namespace, unit.key, unit.token_ids)
    with pytest.raises(UnitCorrupt, match="MAC mismatch"):
        decode(bytes(tampered), unit.namespace, unit.key, unit.token_ids, mac_key=SECRET_NS.mac_key)


def test_a_sealed_unit_keeps_no_token_ids_and_its_reader_checks_its_own(tmp_path):
    """Units written with a MAC key withhold their token ids (a tenant's prompt): the file and
    whoever stores or relays it see zeros; the reader, which knows the tokens it asks for, checks
    that the key is their chain hash, so wrong tokens are still a miss."""
    import numpy as np

    from cachedir.unit import Unit
    from cachedir.unitfile import read_header

    tokens = list(range(7000, 7064))
    unit = make_units(tokens, SECRET_NS)[0]
    sealed = unit.encode(SECRET_NS.mac_key)
    assert np.asarray(tokens, dtype="<u4").tobytes() not in sealed
    assert bytes(unit.payload)[:256] not in sealed  # the KV is encrypted: it would give the prompt away
    assert unit.encode(SECRET_NS.mac_key) != sealed  # a fresh nonce each time
    h = read_header(sealed)
    assert h.sealed and h.token_ids == (0,) * 64
    got, payload = decode(sealed, unit.namespace, unit.key, tokens, mac_key=SECRET_NS.mac_key)
    assert got.token_ids == tuple(tokens) and bytes(payload) == bytes(unit.payload)
    wrong = tokens[:-1] + [1]
    for ids in (wrong, tokens[:-1]):
        with pytest.raises(UnitCorrupt, match="token ids|chain hash"):
            decode(sealed, unit.namespace, unit.key, ids, mac_key=SECRET_NS.mac_key)
    # a store or agent (no tokens, no key) checks damage only, and re-encodes it as it came
    decode(sealed, unit.namespace, unit.key)
    stored = Unit(h.namespace, h.key, h.parent, h.token_ids, sealed[h.header_len:], h.num_layers, h.dim, h.dtype,
                  h.mac, h.sealed)
    assert stored.encode() == sealed
    damaged = bytearray(sealed)
    damaged[-1] ^= 1
    with pytest.raises(UnitCorrupt, match="checksum"):
        decode(bytes(damaged), unit.namespace, unit.key)
    unknown = bytearray(sealed)
    unknown[11] |= 0x80
    with pytest.raises(UnitCorrupt, match="flags"):
        decode(bytes(unknown), unit.namespace, unit.key)
    # written without a key, a unit keeps its ids (nothing could authenticate it anyway)
    assert not read_header(unit.encode()).sealed and read_header(unit.encode()).token_ids == tuple(tokens)


def test_the_secret_file_must_be_private_and_long_enough(tmp_path):
    import os

    from cachedir.hashing import read_secret

    path = tmp_path / "cache.secret"
    with pytest.raises(ValueError, match="No such file"):
        read_secret(str(path))
    path.write_text("x" * 40)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_secret(str(path))
    os.chmod(path, 0o600)
    assert read_secret(str(path)) == b"x" * 40 and read_secret(None) == b""
    path.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(str(path))
