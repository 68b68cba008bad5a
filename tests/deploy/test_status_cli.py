"""``tide status``'s human form from a report (the report itself: ``test_cli_up.py``'s real cluster)."""

from __future__ import annotations

import io

from rich.console import Console

from deploy.status_cli import print_report


def _report() -> dict:
    replica = {"actor_name": "SERVE_REPLICA::tideserve#LLMServer#abc", "node_id": "n" * 28, "threads": 7,
               "running": 2, "waiting": 1, "engine": {"prefill_tokens": 1234, "decode_tokens": 56}}
    totals = {"ssd_units": 3, "ssd_bytes": 3e6, "ssd_pinned": 0, "ssd_hits": 4}
    return {"url": "http://127.0.0.1:8000/v1", "address": "127.0.0.1:6379",
            "nodes": [{"node_id": "n" * 28, "role": "serving", "cpus": 8.0}], "replicas": [replica],
            "cache": {"nodes": {"n" * 28: totals}, "totals": totals}, "expert_placement": None,
            "gpus": {"available": False, "reason": "no NVML", "gpus": []}}


def test_each_replica_shows_the_threads_it_computes_with():
    out = io.StringIO()
    print_report(Console(file=out, width=200, color_system=None), _report())
    text = out.getvalue()
    header = next(line for line in text.splitlines() if "prefill tok" in line)
    row = next(line for line in text.splitlines() if line.lstrip().startswith("abc"))
    assert header.split()[:4] == ["replica", "node", "pool", "threads"]
    assert row.split()[:7] == ["abc", "n" * 12, "both", "7", "2", "1", "1,234"]
    assert "GPUs: none (no NVML)" in text
