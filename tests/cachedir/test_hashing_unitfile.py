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
