"""Keeping the cache through the night: before nodes leave serving, their hot units that no
staying node holds are copied to the nodes that stay; when nodes come back, they fetch the hot
units they lack before they serve, then, budget left, the fleet's other units (``warm_units``).

A node lent to training (or a Kubernetes pod deleted at night) takes its units with it, and
the morning's prompts that shared them would miss. Before it goes, its agent asks the directory
for the hottest units (decayed hit counts), keeps those whose every live holder is leaving,
and pushes each, hottest first, to a staying node (rendezvous hashing of unit and node, so the
copies spread), then (``KeepBudget.fill``) its other units no staying node holds, within a byte
and a time budget. A unit held by several leaving nodes is pushed
by the one with the smallest id, as replication does. Each copy a receiver accepted is
registered in the directory for it at once, so lookups find it there before the receiver's
next sync; the leaving node's own registration stays until its heartbeat lapses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash

from cachedir.directory.base import Directory, DirectoryUnavailable

__all__ = ["KeepBudget", "keep_units", "warm_units"]

FETCH_BATCH = 32  # units asked of one holder in one call


@dataclass(frozen=True, slots=True)
class KeepBudget:
    max_bytes: int = 8 << 30  # encoded unit bytes pushed at most
    deadline_s: float = 60.0  # pushes stop after this long
    min_hits: float = 0.5  # decayed hit count from which a unit counts as hot (one hit within a half-life)
    scan_limit: int = 65536  # hot units examined
    fill: bool = True  # after the hot units, the others (never hit yet, as most new units): kept or warmed

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.deadline_s < 0 or self.scan_limit < 1:
            raise ValueError(f"a keep budget needs max_bytes, deadline_s >= 0 and scan_limit >= 1, got {self}")


def keep_units(node_id: str, directory: Directory, leaving: Iterable[str], read: Callable[[bytes], bytes | None],
               push: Callable[[str, bytes], bool], budget: KeepBudget = KeepBudget(),
               now_s: Callable[[], float] = time.monotonic) -> dict[str, int]:
    """Push ``node_id``'s hot units that only leaving nodes hold to the nodes that stay (``read``:
    a unit's encoded bytes on this node; ``push(address, encoded)``: whether the agent there took
    it), hottest first; with ``budget.fill``, budget and time left, then its other units that only
    leaving nodes hold (a unit not reused yet has no hits, and first reuses are most of the next
    hours' hits). Returns counts: ``kept`` units and their ``bytes``, ``over_budget`` (units left
    behind for the budget), ``failed`` (pushes refused or failed), ``held_elsewhere`` (hot units)."""
    leaving = set(leaving) | {node_id}
    out = {"kept": 0, "bytes": 0, "over_budget": 0, "failed": 0, "held_elsewhere": 0}
    start = now_s()
    try:
        live = directory.live_nodes()
        staying = {n: a for n, a in live.items() if n not in leaving}
        hot = directory.hot_units(budget.scan_limit, len(leaving) + len(staying) + 1, time.time()) if staying else []
    except DirectoryUnavailable:
        return out

    def keep(key: bytes) -> None:
        data = read(key)
        if data is None:
            return
        if out["bytes"] + len(data) > budget.max_bytes or now_s() - start > budget.deadline_s:
            out["over_budget"] += 1
            return
        target = max(staying, key=lambda n: xxhash.xxh3_64_intdigest(key + n.encode()))
        try:
            ok = push(staying[target], data)
        except Exception:  # noqa: BLE001 - a unit not kept is a miss in the morning, not an error
            ok = False
        if not ok:
            out["failed"] += 1
            return
        out["kept"] += 1
        out["bytes"] += len(data)
        try:
            directory.register(target, [key])
        except DirectoryUnavailable:
            pass  # the receiver registers it at its next sync

    seen: set[bytes] = set()
    for unit in hot:
        if unit.hits < budget.min_hits:
            break
        seen.add(unit.key)
        holders = {n for n in unit.holders if n in live}
        if holders - leaving:
            out["held_elsewhere"] += node_id in holders
            continue
        if node_id in holders and node_id == min(holders):  # (else not here, or another leaving holder pushes it)
            keep(unit.key)
    if budget.fill and staying and out["over_budget"] == 0:
        try:
            rest = _only_here(node_id, directory, live, leaving, seen)
        except DirectoryUnavailable:
            rest = []
        for key in rest:
            keep(key)
    return out


def _only_here(node_id: str, directory: Directory, live: dict[str, str], leaving: set[str],
               seen: set[bytes]) -> list[bytes]:
    """``node_id``'s units that no staying node holds, ``seen`` left out, without those a leaving
    node with a smaller id holds (that one pushes them). Reads this node's units and their
    holders, not the fleet's."""
    mine = sorted(directory.node_keys(node_id) - seen)
    covered_by = {n for n in live if n != node_id and (n not in leaving or n < node_id)}
    return [key for key, held in zip(mine, directory.holders(mine), strict=True)
            if not any(h.node_id in covered_by for h in held)]


def warm_units(node_id: str, directory: Directory, fetch: Callable[[str, list[bytes]], list[bytes | None]],
               store: Callable[[bytes], bool], budget: KeepBudget = KeepBudget(),
               now_s: Callable[[], float] = time.monotonic) -> dict[str, int]:
    """A node coming back to serving fetches the hot units it lacks, hottest first, from their
    holders (``fetch(address, keys)``: their encoded bytes, None where gone) and ``store``s each
    (verified there: whether it was kept), within ``budget``; each one stored is registered for
    it at once. With ``budget.fill``, budget and time left, then the other units the live nodes
    hold (those on more nodes first): a unit made yesterday and not reused yet has no hits, and
    it is what most of a fleet's first reuses are. Returns counts: ``warmed`` units and their
    ``bytes``, ``over_budget``, ``failed``."""
    out = {"warmed": 0, "bytes": 0, "over_budget": 0, "failed": 0}
    start = now_s()
    try:
        live = directory.live_nodes()
        hot = directory.hot_units(budget.scan_limit, len(live) + 1, time.time())
    except DirectoryUnavailable:
        return out
    taken: set[bytes] = set()  # keys asked for
    wanted: dict[str, list[bytes]] = {}  # holder -> keys, hottest first
    for unit in hot:
        if unit.hits < budget.min_hits:
            break
        holders = [n for n in unit.holders if n in live and n != node_id]
        if node_id in unit.holders or not holders:
            continue
        wanted.setdefault(min(holders, key=lambda n: len(wanted.get(n, ()))), []).append(unit.key)
        taken.add(unit.key)

    def pull(wanted: dict[str, list[bytes]]) -> None:
        for holder, keys in wanted.items():
            for i in range(0, len(keys), FETCH_BATCH):
                if now_s() - start > budget.deadline_s or out["bytes"] >= budget.max_bytes:  # nothing more fetched
                    out["over_budget"] += len(keys) - i
                    break
                try:
                    got = fetch(live[holder], keys[i : i + FETCH_BATCH])
                except Exception:  # noqa: BLE001 - a holder that cannot answer: those stay misses
                    out["failed"] += len(keys[i : i + FETCH_BATCH])
                    continue
                for key, data in zip(keys[i : i + FETCH_BATCH], got, strict=True):
                    if data is not None and out["bytes"] + len(data) > budget.max_bytes:
                        out["over_budget"] += 1
                        continue
                    if data is None or not store(data):
                        out["failed"] += 1
                        continue
                    out["warmed"] += 1
                    out["bytes"] += len(data)
                    try:
                        directory.register(node_id, [key])
                    except DirectoryUnavailable:
                        pass  # registered at this node's next sync

    pull(wanted)
    if budget.fill and out["over_budget"] == 0:
        try:
            pull(_fleet_units(node_id, directory, live, taken))
        except DirectoryUnavailable:
            pass
    return out


def _fleet_units(node_id: str, directory: Directory, live: dict[str, str], taken: set[bytes]) -> dict[str, list[bytes]]:
    """holder -> the units live nodes hold that ``node_id`` lacks and ``taken`` does not name,
    those held by more nodes first, spread over their holders."""
    mine = directory.node_keys(node_id)
    holders: dict[bytes, list[str]] = {}
    for n in sorted(live):
        if n != node_id:
            for key in directory.node_keys(n):
                if key not in mine and key not in taken:
                    holders.setdefault(key, []).append(n)
    wanted: dict[str, list[bytes]] = {}
    for key, nodes in sorted(holders.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        wanted.setdefault(min(nodes, key=lambda n: len(wanted.get(n, ()))), []).append(key)
    return wanted
