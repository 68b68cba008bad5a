"""deploy.tidal's Serve side (deploy.serve_state) without a cluster: what the night does to Serve's replicas (the day/night cycle
on a real Ray cluster is in tests/actors/test_tidal*.py)."""

from __future__ import annotations

import types

from tests.waiting import until


def test_replicas_serve_stops_before_they_had_a_node_are_killed_and_no_other(monkeypatch):
    """A replacement Serve started for a lent node's replica cannot be placed; when the lower
    count stops it, it is killed at once, once. A stopping replica on a node may still finish
    requests (Serve's grace period is theirs); starting and running ones are Serve's to keep."""
    from deploy import serve_state

    view = {"r-unplaced": ("STOPPING", None), "r-draining": ("STOPPING", "node-a"),
            "r-starting": ("STARTING", None), "r-running": ("RUNNING", "node-b")}
    looks, killed = [], []

    def serve_replicas(app: str) -> dict:
        looks.append(app)
        return dict(view)

    monkeypatch.setattr(serve_state, "ray", types.SimpleNamespace(
        get_actor=lambda name, namespace: (name, namespace), kill=lambda actor, no_restart: killed.append(actor)))
    monkeypatch.setattr(serve_state, "serve_replicas", serve_replicas)
    with serve_state.stopping_unplaced("tideserve", every_s=0.01) as stopped:
        until(lambda: len(looks) >= 5, 30, "five looks at Serve's replicas")  # listed every time
    assert stopped == ["r-unplaced"] and killed == [("r-unplaced", "serve")] and set(looks) == {"tideserve"}
    seen = len(looks)
    view["r-late"] = ("STOPPING", None)
    assert len(looks) == seen and killed == [("r-unplaced", "serve")]  # the block is over: no more looks
