"""Expert-parallel load balancing (EPLB): which expert copies live in which shard slots.

Legend: L MoE layers, E logical experts, G expert groups, N nodes, H expert shards (H/N per
node), S physical slots (S/H per shard, S >= E), C max copies of one expert.

Input: ``load`` [L, E], tokens routed to each expert (a moving average kept by the replicas).
Output: a ``Placement``: ``phy2log`` [L, S] (the expert in each slot; slot s belongs to shard
s // (S/H), shard h to node h // (H/N)), ``log2phy`` [L, E, C] (the slots holding each expert,
-1 padded) and ``logcnt`` [L, E]. Tokens of an expert are spread evenly over its copies, so a
copy carries load/copies.

Policies, following DeepSeek's EPLB:

* ``hierarchical`` (when groups divide evenly over nodes): pack whole expert groups onto nodes
  (group-limited routing then keeps a token's experts on few nodes), replicate the hottest
  experts *within* each node, pack each node's copies onto its shards.
* ``global``: one pool of shards; replicate the hottest experts and pack all copies.
* ``spill``: ``hierarchical``, then move up to ``spill_copies`` redundant copies per layer to
  other nodes: a hot expert of the busiest node gains a copy on the idlest node, which gives up
  its least useful local redundant copy. Whole-group pinning cannot balance nodes whose groups
  are hot; a few spilled copies can, at the price of some cross-node traffic (``spill_fraction``).

Every policy keeps two copies of an expert off the same shard and gives every expert a copy.
Re-planning with ``previous`` moves as few weights as balance allows, per layer: keep the old
placement if it balances the new load within ``keep_tolerance`` of a fresh plan; else *repair* it
(change only the copy counts that the fresh plan changes, node by node, then swap copies between
shards of a node until within tolerance); else take the fresh plan lined up with the old one
(nodes, shards and slots matched by overlap).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

__all__ = [
    "EplbConfig",
    "POLICIES",
    "Placement",
    "imbalance",
    "moved_slots",
    "plan",
    "shard_loads",
    "spill_fraction",
]

POLICIES = ("auto", "global", "hierarchical", "spill")


@dataclass(frozen=True, slots=True)
class EplbConfig:
    num_slots: int
    num_groups: int
    num_nodes: int
    num_shards: int
    policy: str = "auto"
    spill_copies: int = 16
    keep_tolerance: float = 0.01

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_groups", "num_nodes", "num_shards"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_shards % self.num_nodes:
            raise ValueError(f"num_shards {self.num_shards} must divide evenly over {self.num_nodes} nodes")
        if self.num_slots % self.num_shards:
            raise ValueError(f"num_slots {self.num_slots} must divide evenly over {self.num_shards} shards")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; supported: {', '.join(POLICIES)}")
        if self.spill_copies < 0:
            raise ValueError(f"spill_copies must be >= 0, got {self.spill_copies}")

    @property
    def slots_per_shard(self) -> int:
        return self.num_slots // self.num_shards

    def resolve_policy(self, num_experts: int) -> str:
        """``auto`` -> ``hierarchical`` when groups divide evenly over nodes and each node's shards
        can be filled from its own experts (no expert twice on a shard), else ``global``."""
        if self.policy != "auto":
            return self.policy
        even = self.num_groups % self.num_nodes == 0 and num_experts % self.num_groups == 0
        fits = self.slots_per_shard <= num_experts // self.num_nodes
        return "hierarchical" if even and fits else "global"


@dataclass(frozen=True, slots=True)
class Placement:
    phy2log: torch.Tensor  # [L, S] long
    log2phy: torch.Tensor  # [L, E, C] long, -1 padded
    logcnt: torch.Tensor  # [L, E] long
    num_shards: int

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int, num_shards: int) -> Placement:
        """Derive ``log2phy`` and ``logcnt`` from ``phy2log`` [L, S]."""
        phy2log = phy2log.long()
        num_layers = phy2log.shape[0]
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.long)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        width = max(1, int(logcnt.max()))
        log2phy = torch.full((num_layers, num_experts, width), -1, dtype=torch.long)
        for layer in range(num_layers):
            seen = [0] * num_experts
            for slot, e in enumerate(phy2log[layer].tolist()):
                log2phy[layer, e, seen[e]] = slot
                seen[e] += 1
        return cls(phy2log, log2phy, logcnt, num_shards)

    @classmethod
    def in_order(cls, num_layers: int, num_experts: int, num_shards: int) -> Placement:
        """No redundancy: expert e in slot e (the layout before any balancing)."""
        return cls.from_phy2log(torch.arange(num_experts).expand(num_layers, -1), num_experts, num_shards)

    @property
    def slots_per_shard(self) -> int:
        return self.phy2log.shape[1] // self.num_shards

    def shard_of_slot(self) -> torch.Tensor:
        return torch.arange(self.phy2log.shape[1]) // self.slots_per_shard  # [S]

    def check_integrity(self) -> None:
        """Every expert has a copy, shards have equal slots, ``log2phy`` inverts ``phy2log``, no
        shard holds two copies of one expert."""
        num_layers, num_slots = self.phy2log.shape
        num_experts = self.logcnt.shape[1]
        assert num_slots % self.num_shards == 0, (num_slots, self.num_shards)
        assert (self.logcnt >= 1).all(), "an expert has no copy"
        assert int(self.logcnt.sum()) == num_layers * num_slots, "logcnt does not count every slot"
        for layer in range(num_layers):
            row = self.phy2log[layer].tolist()
            for e in range(num_experts):
                slots = [s for s in self.log2phy[layer, e].tolist() if s >= 0]
                assert len(slots) == self.logcnt[layer, e], (layer, e, slots)
                assert all(row[s] == e for s in slots), f"log2phy[{layer}, {e}] = {slots} disagrees"
            per = self.slots_per_shard
            for shard in range(self.num_shards):
                held = row[shard * per : (shard + 1) * per]
                assert len(set(held)) == len(held), f"layer {layer} shard {shard} repeats an expert: {held}"


def plan(load: torch.Tensor, cfg: EplbConfig, previous: Placement | None = None) -> Placement:
    """Place ``load`` [L, E] (tokens per expert) onto ``cfg.num_slots`` slots. See the module doc."""
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, experts], got shape {tuple(load.shape)}")
    num_layers, num_experts = load.shape
    if num_experts % cfg.num_groups:
        raise ValueError(f"num_groups {cfg.num_groups} must divide the {num_experts} experts")
    if cfg.num_slots < num_experts:
        raise ValueError(f"num_slots {cfg.num_slots} < {num_experts} experts: every expert needs a slot")
    if (load < 0).any() or not torch.isfinite(load).all():
        raise ValueError("load must be finite and >= 0")
    policy = cfg.resolve_policy(num_experts)
    if policy != "global" and (cfg.num_groups % cfg.num_nodes or (cfg.num_slots // cfg.num_nodes) < (
        num_experts // cfg.num_nodes
    )):
        raise ValueError(
            f"policy {policy!r} needs the {cfg.num_groups} groups to divide evenly over {cfg.num_nodes} "
            "nodes and each node to have a slot per expert; use policy 'global'"
        )
    pool = num_experts if policy == "global" else num_experts // cfg.num_nodes
    if cfg.slots_per_shard > pool:
        raise ValueError(
            f"{cfg.slots_per_shard} slots per shard exceed the {pool} experts a shard can choose "
            "from (no shard holds two copies of an expert)"
        )
    if previous is not None and tuple(previous.phy2log.shape) != (num_layers, cfg.num_slots):
        previous = None  # a different layout (e.g. fewer shards after scale-down): plan afresh
    rows = []
    for layer in range(num_layers):
        w = [float(v) for v in load[layer].tolist()]
        shards = _plan_layer(w, cfg, policy)
        row = [e for s in shards for e in s]
        if previous is not None:
            row = _replan(previous.phy2log[layer].tolist(), shards, w, cfg, policy)
        rows.append(row)
    return Placement.from_phy2log(torch.tensor(rows, dtype=torch.long), num_experts, cfg.num_shards)


# -- metrics ------------------------------------------------------------------------------------
def shard_loads(placement: Placement, load: torch.Tensor) -> torch.Tensor:
    """Load per shard [L, H], each copy carrying load/copies."""
    per_copy = load.double() / placement.logcnt.double()  # [L, E]
    slot_load = per_copy.gather(1, placement.phy2log)  # [L, S]
    return slot_load.view(slot_load.shape[0], placement.num_shards, -1).sum(-1)


def imbalance(placement: Placement, load: torch.Tensor) -> float:
    """Max/mean shard load, averaged over layers (each layer is its own all-to-all)."""
    s = shard_loads(placement, load)
    return float((s.max(1).values / s.mean(1).clamp_min(1e-12)).mean())


def spill_fraction(placement: Placement, load: torch.Tensor, num_groups: int, num_nodes: int) -> float:
    """Share of the load served by copies on a node other than their group's home node (the node
    serving most of the group's load)."""
    num_layers, num_experts = load.shape
    node_of_slot = placement.shard_of_slot() // (placement.num_shards // num_nodes)  # [S]
    per_copy = load.double() / placement.logcnt.double()
    group_of = placement.phy2log // (num_experts // num_groups)  # [L, S]
    served = torch.zeros(num_layers, num_groups, num_nodes, dtype=torch.double)
    for layer in range(num_layers):
        served[layer].index_put_(
            (group_of[layer], node_of_slot), per_copy[layer, placement.phy2log[layer]], accumulate=True
        )
    home = served.max(-1).values.sum()
    total = served.sum()
    return float((total - home) / total) if total > 0 else 0.0


def moved_slots(old: Placement, new: Placement) -> int:
    """Slots whose expert changes (weights that must be copied)."""
    if old.phy2log.shape != new.phy2log.shape:
        return int(new.phy2log.numel())
    return int((old.phy2log != new.phy2log).sum())


# -- one layer ----------------------------------------------------------------------------------
def _plan_layer(load: list[float], cfg: EplbConfig, policy: str) -> list[list[int]]:
    """Experts of each shard, in shard order."""
    num_experts = len(load)
    nodes = 1 if policy == "global" else cfg.num_nodes
    shards_per_node = cfg.num_shards // nodes
    slots_per_node = cfg.num_slots // nodes
    group_size = num_experts // cfg.num_groups
    if nodes == 1:
        node_experts = [list(range(num_experts))]
    else:
        group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(cfg.num_groups)]
        node_groups = _pack_counts(group_load, nodes, cfg.num_groups // nodes)
        node_experts = [[e for g in gs for e in range(g * group_size, (g + 1) * group_size)] for gs in node_groups]
    cnt = [1] * num_experts
    copies = [dict.fromkeys(experts, 1) for experts in node_experts]  # per node: expert -> copies
    for n, experts in enumerate(node_experts):
        for _ in range(slots_per_node - len(experts)):
            e = max(
                (x for x in experts if copies[n][x] < shards_per_node),
                key=lambda x: load[x] / cnt[x],
                default=None,
            )
            if e is None:  # every expert already has a copy on every shard of the node
                raise ValueError(f"{slots_per_node} slots per node exceed what {len(experts)} experts can fill")
            copies[n][e] += 1
            cnt[e] += 1
    if policy == "spill" and nodes > 1:
        _spill(load, copies, cnt, shards_per_node, cfg.spill_copies)
    shards: list[list[int]] = []
    for n in range(nodes):
        shards += _pack_copies(copies[n], load, cnt, shards_per_node, cfg.slots_per_shard)
    return shards


def _pack_counts(weights: list[float], num_bins: int, per_bin: int) -> list[list[int]]:
    """Items (heaviest first) into the lightest bin with room; each bin gets ``per_bin`` items."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        b = min((b for b in range(num_bins) if len(bins[b]) < per_bin), key=lambda b: totals[b])
        bins[b].append(i)
        totals[b] += weights[i]
    return bins


def _pack_copies(
    copies: dict[int, int], load: list[float], cnt: list[int], num_shards: int, per_shard: int
) -> list[list[int]]:
    """Copies of one node onto its shards, no expert twice on a shard. Heaviest copy first into
    the lightest shard with room; if that order strands an expert's copies (too few shards with
    room left), place multi-copy experts first instead."""
    by_weight = sorted(copies, key=lambda e: -load[e] / cnt[e])
    for order in (by_weight, sorted(by_weight, key=lambda e: copies[e] == 1)):
        shards: list[list[int]] = [[] for _ in range(num_shards)]
        totals = [0.0] * num_shards
        for e in order:
            room = [s for s in range(num_shards) if len(shards[s]) < per_shard and e not in shards[s]]
            if len(room) < copies[e]:
                break
            for s in sorted(room, key=lambda s: totals[s])[: copies[e]]:
                shards[s].append(e)
                totals[s] += load[e] / cnt[e]
        else:
            return shards
    raise AssertionError(f"cannot place copies {copies} on {num_shards} shards of {per_shard} slots")


def _spill(
    load: list[float], copies: list[dict[int, int]], cnt: list[int], shards_per_node: int, budget: int
) -> None:
    """Move redundant copies from idle nodes to hot experts of busy nodes while it lowers the
    estimated shard maximum (max of node load / shards per node and the largest copy)."""

    def estimate() -> float:
        node_max = max(sum(load[e] * c / cnt[e] for e, c in node.items()) for node in copies)
        return max(node_max / shards_per_node, max(load[e] / cnt[e] for e in range(len(load))))

    for _ in range(budget):
        node_load = [sum(load[e] * c / cnt[e] for e, c in node.items()) for node in copies]
        busy = max(range(len(copies)), key=lambda n: node_load[n])
        idle = min(range(len(copies)), key=lambda n: node_load[n])
        if busy == idle:
            return
        hot = max(
            (e for e in copies[busy] if copies[idle].get(e, 0) < shards_per_node),
            key=lambda e: load[e] / cnt[e],
            default=None,
        )
        spare = min(
            (e for e in copies[idle] if cnt[e] > 1 and e != hot),  # cnt > 1: a copy survives
            key=lambda e: load[e] / (cnt[e] - 1),
            default=None,
        )
        if hot is None or spare is None:
            return
        before = estimate()
        _move(copies, cnt, idle, add=hot, remove=spare)
        if estimate() >= before:
            _move(copies, cnt, idle, add=spare, remove=hot)  # undo
            return


def _move(copies: list[dict[int, int]], cnt: list[int], node: int, add: int, remove: int) -> None:
    copies[node][add] = copies[node].get(add, 0) + 1
    cnt[add] += 1
    copies[node][remove] -= 1
    if copies[node][remove] == 0:
        del copies[node][remove]
    cnt[remove] -= 1


# -- stable re-planning -------------------------------------------------------------------------
def _replan(old: list[int], fresh: list[list[int]], load: list[float], cfg: EplbConfig, policy: str) -> list[int]:
    fresh_row = [e for s in _align(fresh, old, cfg, policy) for e in s]
    target = _row_imbalance(fresh_row, load, cfg) + cfg.keep_tolerance
    if _row_imbalance(old, load, cfg) <= target:
        return old
    nodes = 1 if policy == "global" else cfg.num_nodes
    repaired = _repair(old, fresh_row, load, cfg, nodes, target)
    if repaired is not None and _row_imbalance(repaired, load, cfg) <= target:
        return repaired
    return fresh_row


def _repair(
    old: list[int], fresh: list[int], load: list[float], cfg: EplbConfig, nodes: int, target: float
) -> list[int] | None:
    """``old`` with each node's copy counts changed to ``fresh``'s (which is aligned to ``old``),
    then copies swapped between shards of a node until the imbalance reaches ``target``. None when
    a new copy finds no shard without that expert."""
    per = cfg.slots_per_shard
    row: list[int] = list(old)
    cnt = [0] * len(load)
    for e in fresh:
        cnt[e] += 1
    w = [load[e] / cnt[e] if cnt[e] else 0.0 for e in range(len(load))]
    shard_load = [sum(w[e] for e in row[i : i + per]) for i in range(0, len(row), per)]
    node_slots = cfg.num_slots // nodes
    for n in range(nodes):
        lo, hi = n * node_slots, (n + 1) * node_slots
        have, want = Counter(row[lo:hi]), Counter(fresh[lo:hi])
        freed: list[int] = []
        for e, extra in (have - want).items():  # drop surplus copies from the busiest shards
            slots = sorted((i for i in range(lo, hi) if row[i] == e), key=lambda i: -shard_load[i // per])
            freed += slots[:extra]
        for i in freed:
            shard_load[i // per] -= w[row[i]]
            row[i] = -1
        for e in sorted((want - have).elements(), key=lambda e: -w[e]):  # hottest new copies first
            ok = [i for i in freed if row[i] == -1 and e not in row[i // per * per : i // per * per + per]]
            if not ok:
                return None
            i = min(ok, key=lambda i: shard_load[i // per])
            row[i] = e
            shard_load[i // per] += w[e]
        _swap_balance(row, w, shard_load, per, range(lo // per, hi // per), target)
    return row


def _swap_balance(
    row: list[int], w: list[float], shard_load: list[float], per: int, shards: range, target: float
) -> None:
    """Swap one copy of the busiest shard with one of another shard (the swap that lowers the
    pair's maximum most) until the node reaches ``target`` x the mean or no swap helps."""
    mean = sum(shard_load) / len(shard_load)
    for _ in range(len(shards) * per):
        a = max(shards, key=lambda s: shard_load[s])
        if shard_load[a] <= target * mean:
            return
        a_set = set(row[a * per : (a + 1) * per])
        best: tuple[float, int, int] | None = None
        for b in shards:
            if b == a:
                continue
            b_set = set(row[b * per : (b + 1) * per])
            for i in range(a * per, (a + 1) * per):
                for j in range(b * per, (b + 1) * per):
                    x, y = row[i], row[j]
                    d = w[x] - w[y]
                    if d <= 0 or x in b_set or y in a_set:
                        continue
                    peak = max(shard_load[a] - d, shard_load[b] + d)
                    if peak < shard_load[a] - 1e-12 and (best is None or peak < best[0]):
                        best = (peak, i, j)
        if best is None:
            return
        _, i, j = best
        d = w[row[i]] - w[row[j]]
        row[i], row[j] = row[j], row[i]
        shard_load[i // per] -= d
        shard_load[j // per] += d


def _align(shards: list[list[int]], old: list[int], cfg: EplbConfig, policy: str) -> list[list[int]]:
    """Renumber nodes and shards of a fresh placement to overlap the old one most, and keep each
    shared expert in its old slot."""
    per = cfg.slots_per_shard
    old_shards = [old[i : i + per] for i in range(0, len(old), per)]
    nodes = 1 if policy == "global" else cfg.num_nodes
    k = cfg.num_shards // nodes
    node_sets = [sum(shards[n * k : (n + 1) * k], []) for n in range(nodes)]
    old_node_sets = [sum(old_shards[n * k : (n + 1) * k], []) for n in range(nodes)]
    node_map = _match(node_sets, old_node_sets)  # new node -> old node position
    out: list[list[int]] = [[] for _ in range(cfg.num_shards)]
    for n in range(nodes):
        m = node_map[n]
        mine, theirs = shards[n * k : (n + 1) * k], old_shards[m * k : (m + 1) * k]
        for i, j in enumerate(_match(mine, theirs)):
            out[m * k + j] = _keep_positions(mine[i], theirs[j])
    return out


def _match(new: list[list[int]], old: list[list[int]]) -> list[int]:
    """Greedy maximum-overlap assignment: new[i] -> position in old."""
    overlap = [(len(set(a) & set(b)), i, j) for i, a in enumerate(new) for j, b in enumerate(old)]
    result = [-1] * len(new)
    used: set[int] = set()
    for _, i, j in sorted(overlap, key=lambda t: -t[0]):
        if result[i] < 0 and j not in used:
            result[i] = j
            used.add(j)
    return result


def _keep_positions(experts: list[int], old_slots: list[int]) -> list[int]:
    slots: list[int | None] = [None] * len(old_slots)
    rest = list(experts)
    for pos, e in enumerate(old_slots):
        if e in rest:
            slots[pos] = e
            rest.remove(e)
    it = iter(rest)
    return [s if s is not None else next(it) for s in slots]


def _row_imbalance(row: list[int], load: list[float], cfg: EplbConfig) -> float:
    cnt = [0] * len(load)
    for e in row:
        cnt[e] += 1
    if min(cnt) == 0:
        return float("inf")
    per = cfg.slots_per_shard
    totals = [sum(load[e] / cnt[e] for e in row[i : i + per]) for i in range(0, len(row), per)]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0
