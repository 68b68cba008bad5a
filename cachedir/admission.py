"""Admission policies: which units of a finished input or output are persisted.

Every policy sees the chain keys of a request's whole units at two moments: when the input ends
(prompt units) and when the output ends (prompt + output units). It answers with an ``Admit``:

* ``units``: indices of units to store (content-addressed, each stored once);
* ``prefixes``: for the ``deepseek`` policy only, prefix lengths (in units, from token 0) that
  become whole "cache prefix units", matched only whole.

Policies keep bounded memory (an LRU of recently seen keys), take no clock and do no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["AllUnits", "Admit", "AdmissionPolicy", "DeepSeekPrefixes", "SecondSight", "make_admission"]


@dataclass(frozen=True, slots=True)
class Admit:
    units: list[int] = field(default_factory=list)
    prefixes: list[int] = field(default_factory=list)


class AdmissionPolicy(Protocol):
    whole_prefixes: bool  # True: lookups match only whole stored prefixes

    def on_input_end(self, keys: list[bytes]) -> Admit: ...

    def on_output_end(self, keys: list[bytes], num_input_units: int) -> Admit: ...


class _SeenKeys:
    """Bounded LRU of key -> sightings (distinct requests)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"seen-key capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._count: OrderedDict[bytes, int] = OrderedDict()

    def get(self, key: bytes) -> int:
        return self._count.get(key, 0)

    def add(self, key: bytes) -> int:
        n = self._count.pop(key, 0) + 1
        self._count[key] = n
        if len(self._count) > self.capacity:
            self._count.popitem(last=False)
        return n


class AllUnits:
    """Persist every whole unit of the prompt, then of prompt + output."""

    whole_prefixes = False

    def on_input_end(self, keys: list[bytes]) -> Admit:
        return Admit(units=list(range(len(keys))))

    def on_output_end(self, keys: list[bytes], num_input_units: int) -> Admit:
        return Admit(units=list(range(num_input_units, len(keys))))


class SecondSight:
    """Persist a unit only from its second sighting (in two requests): fewer one-off writes."""

    whole_prefixes = False

    def __init__(self, seen_capacity: int = 1_000_000) -> None:
        self._seen = _SeenKeys(seen_capacity)

    def on_input_end(self, keys: list[bytes]) -> Admit:
        return Admit(units=[i for i, k in enumerate(keys) if self._seen.add(k) >= 2])

    def on_output_end(self, keys: list[bytes], num_input_units: int) -> Admit:
        new = keys[num_input_units:]
        return Admit(units=[num_input_units + i for i, k in enumerate(new) if self._seen.add(k) >= 2])


class DeepSeekPrefixes:
    """DeepSeek's three triggers; each persisted item is a whole prefix from token 0.

    1. The end of the input and the end of the output are prefix boundaries.
    2. A common prefix: when a request's longest prefix shared with an earlier request ends
       before the request does, that boundary becomes a prefix unit of its own.
    3. Every ``every_units`` units inside a long input or output.
    """

    whole_prefixes = True

    def __init__(self, every_units: int = 64, seen_capacity: int = 1_000_000) -> None:
        if every_units <= 0:
            raise ValueError(f"every_units must be > 0, got {every_units}")
        self.every_units = every_units
        self._seen = _SeenKeys(seen_capacity)

    def _admit(self, boundaries: set[int], n: int) -> Admit:
        prefixes = sorted(b for b in boundaries if 0 < b <= n)
        return Admit(units=list(range(prefixes[-1])) if prefixes else [], prefixes=prefixes)

    def on_input_end(self, keys: list[bytes]) -> Admit:
        n = len(keys)
        common = 0
        for i, k in enumerate(keys):  # chain keys: a shared key means a shared prefix
            if self._seen.get(k) == 0:
                break
            common = i + 1
        for k in keys:
            self._seen.add(k)
        boundaries = {n} | set(range(self.every_units, n, self.every_units))
        if 0 < common < n:
            boundaries.add(common)
        return self._admit(boundaries, n)

    def on_output_end(self, keys: list[bytes], num_input_units: int) -> Admit:
        n = len(keys)
        for k in keys[num_input_units:]:
            self._seen.add(k)
        boundaries = {n} | set(range(num_input_units + self.every_units, n, self.every_units))
        return self._admit(boundaries - {num_input_units}, n)


POLICIES = ("all", "deepseek", "second-sight")


def make_admission(name: str, every_units: int = 64) -> AdmissionPolicy:
    if name == "all":
        return AllUnits()
    if name == "second-sight":
        return SecondSight()
    if name == "deepseek":
        return DeepSeekPrefixes(every_units)
    raise ValueError(f"unknown admission policy {name!r}; supported: {', '.join(POLICIES)}")
