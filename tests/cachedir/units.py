"""Helpers that make real cache units."""

from __future__ import annotations

import numpy as np

from cachedir.hashing import Namespace, chain_keys
from cachedir.unit import Unit

NS = Namespace("fp-test", "rev1", "float32", "mla-latent:16+8", 64)


def make_units(tokens, ns: Namespace = NS, layers: int = 2, dim: int = 24, seed: int = 0) -> list[Unit]:
    keys = chain_keys(ns.seed, tokens, ns.unit_size)
    rng = np.random.default_rng(seed)
    units, parent = [], ns.seed
    for i, key in enumerate(keys):
        toks = tuple(int(t) for t in tokens[i * ns.unit_size : (i + 1) * ns.unit_size])
        payload = rng.standard_normal((layers, ns.unit_size, dim), dtype=np.float32).tobytes()
        units.append(Unit(ns.seed, key, parent, toks, payload, layers, dim, "float32"))
        parent = key
    return units


def flip_byte(store, key: bytes, from_end: int = 10) -> None:
    """Flip one payload byte of ``key``'s record in place (either store layout)."""
    loc = store.location(key)
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + loc.length - from_end)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
