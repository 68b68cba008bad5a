"""The versions of an app's expert placement and the replicas that follow them: who serves which
version, which versions must stay on the shards, when nobody follows any more. Pure state with an
injected clock; ``actors/ep_control.py`` holds one and does the loading, switching and dropping
on the shards (and the locking).

The life of a version: ``add`` makes it the target; replicas ``join`` (with the version they
serve, or the target), ``poll`` (their version and measured load; the answer says whether to
switch or, when this state does not know them, to re-join) and ``leave``. A replica that has not
polled for ``replica_timeout_s`` is not live. ``droppable`` names the versions that neither the
target nor a live replica serves: only those may leave the shards. ``unfollowed_for`` says how
long no live replica followed, after which the whole placement may be forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.eplb import Placement

__all__ = ["PlacementVersions", "Poll", "Version"]


@dataclass(frozen=True, slots=True)
class Version:
    placement: Placement
    shards: tuple  # the shards (handles) it is loaded on, in slot order


@dataclass(slots=True)
class _Replica:
    version: int
    seen: float
    load: torch.Tensor | None = None


class Poll:
    """What a poll answers: nothing to do (None), ``SWITCH`` to the target, or ``REJOIN``."""

    SWITCH = "switch"
    REJOIN = "rejoin"


class PlacementVersions:
    def __init__(self, replica_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if replica_timeout_s <= 0:
            raise ValueError(f"replica_timeout_s must be > 0, got {replica_timeout_s}")
        self.replica_timeout_s = replica_timeout_s
        self._clock = clock
        self.current: int | None = None  # the target version (None: no placement yet)
        self._versions: dict[int, Version] = {}
        self._replicas: dict[str, _Replica] = {}
        self._unfollowed_since: float | None = None

    # -- versions ------------------------------------------------------------------------
    def add(self, version: int, placement: Placement, shards, target: bool = True) -> None:
        """A version loaded on ``shards``; the target from now on unless ``target`` is False."""
        if version in self._versions:
            raise ValueError(f"placement version {version} exists already")
        self._versions[version] = Version(placement, tuple(shards))
        if target:
            self.current = version

    def get(self, version: int) -> Version | None:
        return self._versions.get(version)

    @property
    def target(self) -> Version:
        if self.current is None:
            raise LookupError("there is no placement yet")
        return self._versions[self.current]

    def held(self) -> list[int]:
        return sorted(self._versions)

    def forget_all(self) -> list[Version]:
        """No placement any more (nobody follows it); returns what was held, to drop."""
        gone = list(self._versions.values())
        self._versions.clear()
        self._replicas.clear()
        self.current, self._unfollowed_since = None, None
        return gone

    # -- replicas ------------------------------------------------------------------------
    def join(self, replica_id: str, serving: int | None = None) -> None:
        """``replica_id`` serves ``serving`` (a version it brings back) or the target."""
        if self.current is None:
            raise LookupError("there is no placement to join")
        self._replicas[replica_id] = _Replica(self.current if serving is None else serving, self._clock())

    def poll(self, replica_id: str, version: int, load: torch.Tensor | None = None) -> str | None:
        """``replica_id`` serves ``version`` and measured ``load`` [L, E] (None: unchanged)."""
        r = self._replicas.get(replica_id)
        if r is None or self.current is None:
            return Poll.REJOIN
        r.version, r.seen = version, self._clock()
        if load is not None:
            r.load = load
        return Poll.SWITCH if version != self.current else None

    def leave(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def live(self) -> dict[str, int]:
        """Replica -> the version it serves, for the replicas that polled recently."""
        now = self._clock()
        return {rid: r.version for rid, r in self._replicas.items() if now - r.seen < self.replica_timeout_s}

    def pending(self, version: int) -> list[str]:
        """The live replicas that do not serve ``version`` yet."""
        return sorted(rid for rid, v in self.live().items() if v != version)

    def load(self, num_layers: int, num_experts: int) -> torch.Tensor:
        """Tokens per expert [L, E] summed over the live replicas (each decays its own)."""
        total = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        now = self._clock()
        for r in self._replicas.values():
            if r.load is not None and now - r.seen < self.replica_timeout_s:
                total += r.load
        return total

    # -- what the shards may drop --------------------------------------------------------
    def droppable(self) -> tuple[list[int], list[int]]:
        """(versions to forget: neither the target nor served by a live replica, which this
        removes; versions to keep on every shard though they are unknown here: a live replica
        serves them, placed before this state was made)."""
        keep = {self.current} | set(self.live().values())
        gone = [v for v in self._versions if v not in keep]
        for v in gone:
            del self._versions[v]
        return gone, sorted(v for v in keep if v is not None and v not in self._versions)

    def unfollowed_for(self) -> float:
        """Seconds since a placement last had a live replica (0 while it has one, or has none)."""
        if self.current is None or self.live():
            self._unfollowed_since = None
            return 0.0
        now = self._clock()
        if self._unfollowed_since is None:
            self._unfollowed_since = now
        return now - self._unfollowed_since
