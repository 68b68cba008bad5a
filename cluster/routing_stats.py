"""What a replica reports to the request routers: its node, queue, KV capacity and measured cost
model. Ray Serve carries it as a dict (``record_routing_stats``); both sides use this type."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.prefill_lb import CostModel

__all__ = ["RoutingStats"]


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """``time``: when it was taken (wall clock); ``draining``: the replica's node is being lent
    to training (no new work); ``queued``: (new, cached) tokens of each request waiting there;
    ``samples``: prefill chunks its cost model was fitted on; ``kv_tokens`` and ``page_size``:
    its KV pool (the decode router's capacity); ``cost``: None before it reported one."""

    node: str = ""
    time: float = 0.0
    draining: bool = False
    queued: tuple[tuple[int, int], ...] = ()
    running: int = 0
    samples: int = 0
    kv_tokens: int = 0
    page_size: int = 0
    cost: CostModel | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["cost"] = dataclasses.asdict(self.cost) if self.cost is not None else None
        return out

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> RoutingStats:
        """The stats a replica reported (none yet: the defaults)."""
        if not raw:
            return cls()
        cost = raw.get("cost")
        return cls(str(raw.get("node", "")), float(raw.get("time", 0.0)), bool(raw.get("draining", False)),
                   tuple((int(n), int(c)) for n, c in raw.get("queued", ())), int(raw.get("running", 0)),
                   int(raw.get("samples", 0)), int(raw.get("kv_tokens", 0)), int(raw.get("page_size", 0)),
                   CostModel(**cost) if cost else None)
