"""The cache unit value type and the store events."""

from __future__ import annotations

from dataclasses import dataclass

from cachedir.unitfile import NO_MAC, encode, encode_parts

__all__ = ["Unit", "UnitRemoved", "UnitStored"]


@dataclass(frozen=True, slots=True)
class Unit:
    """One cache unit: the latent KV of ``len(token_ids)`` tokens for every layer.

    ``payload`` holds a [num_layers, len(token_ids), dim] array of ``dtype`` as raw bytes (``bytes``
    or a read-only ``memoryview`` of a file buffer). ``mac``: the MAC it arrived with, kept by
    stores that re-encode it (they hold no MAC key). ``sealed``: its file withholds the token
    ids, and so does this unit (zeros) unless its reader filled in the ones it asked for.
    """

    namespace: bytes
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    payload: bytes | memoryview
    num_layers: int
    dim: int
    dtype: str
    mac: bytes = NO_MAC
    sealed: bool = False

    def encode(self, mac_key: bytes | None = None) -> bytes:
        """The unit file's bytes; ``mac_key`` authenticates them (``cachedir.unitfile``), else
        they carry ``mac``."""
        return encode(self.namespace, self.key, self.parent, self.token_ids, self.payload,
                      self.num_layers, self.dim, self.dtype, mac_key, self.mac, self.sealed)

    def encode_parts(self, mac_key: bytes | None = None) -> tuple[bytes, bytes]:
        """Header and payload of ``encode``, unjoined (the store writes them one after the other)."""
        return encode_parts(self.namespace, self.key, self.parent, self.token_ids, self.payload,
                            self.num_layers, self.dim, self.dtype, mac_key, self.mac, self.sealed)


@dataclass(frozen=True, slots=True)
class UnitStored:
    key: bytes
    nbytes: int
    tier: str  # "ram" | "ssd"


@dataclass(frozen=True, slots=True)
class UnitRemoved:
    key: bytes
    tier: str
