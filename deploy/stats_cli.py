"""``tide stats``: DeepSeek's daily report for this cluster (``cluster.daily_report``).

Reads the usage logs every replica appends to (``$TIDE_HOME/usage/*.jsonl`` and their rotated
files, one line per finished request) and the serving-node log (``$TIDE_HOME/nodes.jsonl``: ``tide up`` and ``tide scale``
append a sample whenever the number of serving nodes changes).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import typer

from cluster.daily_report import (
    NodeSample,
    Prices,
    UsageRecord,
    daily_report,
    log_files,
    read_jsonl,
    timeline,
)
from cluster.scaling import Schedule

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise typer.BadParameter(f"--window {text!r} must be a positive number with s, m, h or d (e.g. 24h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def stats(
    window: str = typer.Option("24h", "--window", help="report period ending now: 90m, 24h, 7d"),
    usage_dir: Path = typer.Option(None, "--usage-dir", help="usage logs (default: $TIDE_HOME/usage)"),
    nodes_log: Path = typer.Option(None, "--nodes-log", help="serving-node samples (default: $TIDE_HOME/nodes.jsonl)"),
    price_hit: float = typer.Option(0.07, "--price-hit", min=0, help="per 1M cache-hit input tokens"),
    price_miss: float = typer.Option(0.27, "--price-miss", min=0, help="per 1M cache-miss input tokens"),
    price_output: float = typer.Option(1.10, "--price-output", min=0, help="per 1M output tokens"),
    node_hour_cost: float = typer.Option(16.0, "--node-hour-cost", min=0, help="cost of one serving node-hour"),
    night_discount: float = typer.Option(0.0, "--night-discount", min=0, max=0.99, help="e.g. 0.5: half price at night"),
    batch_discount: float = typer.Option(0.5, "--batch-discount", min=0, max=0.99,
                                         help="batch lines' (/v1/batches) price off the list; 0.5: half, as OpenAI's"),
    night: str = typer.Option("00:30-08:30", "--night", help="night window HH:MM-HH:MM for the discount"),
    timezone: str = typer.Option("Asia/Shanghai", "--tz", help="timezone of --night"),
    now: float = typer.Option(None, "--now", help="end of the window as Unix time (default: now)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    plot: Path = typer.Option(None, "--plot", help="also draw the daily chart (serving nodes, tokens, cache hit rate) "
                              "into this file (.png/.svg/.pdf; needs matplotlib: tideserve[plot])"),
    bins: int = typer.Option(24, "--bins", min=1, max=10_000, help="--plot: slices of the window"),
) -> None:
    """Input tokens, cache-hit tokens and rate, output tokens, average output tokens/s per request,
    average KV length, serving nodes peak/average, theoretical revenue against node-hour cost; the
    batch lines' share (priced at --batch-discount) and the node-hours lent to training."""
    from model.default import cache_root

    window_s = parse_window(window)
    usage_dir = usage_dir or cache_root() / "usage"
    nodes_log = nodes_log or cache_root() / "nodes.jsonl"
    if not usage_dir.is_dir():
        raise typer.BadParameter(f"--usage-dir {str(usage_dir)!r} does not exist (has the cluster served yet?)")
    try:
        start, _, end = night.partition("-")
        schedule = Schedule.parse(end, start, timezone)  # the night ends when the day starts
    except ValueError as e:
        raise typer.BadParameter(f"--night/--tz: {e}") from None
    prices = Prices(price_hit, price_miss, price_output, node_hour_cost, night_discount, schedule, batch_discount)
    usage = read_jsonl(log_files(usage_dir), UsageRecord)
    nodes = read_jsonl(log_files(nodes_log.parent, nodes_log.name), NodeSample)
    end_s = now if now is not None else time.time()
    report = daily_report(usage, nodes, window_s, end_s, prices)
    if plot is not None:
        if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise typer.BadParameter(f"--plot {str(plot)!r}: the file must end in .png, .svg or .pdf")
        from deploy.stats_plot import plot_timeline

        try:
            plot_timeline(timeline(usage, nodes, window_s, end_s, bins), plot, timezone,
                          title=f"tideserve, {report['window_start'][:16]} .. {report['window_end'][:16]} UTC")
        except ImportError as e:
            raise typer.BadParameter(str(e)) from None
        report["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    from rich.table import Table

    from deploy.term import stdout_console

    table = Table(title=f"tideserve, {report['window_start']} .. {report['window_end']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in _rows(report):
        table.add_row(label, value)
    stdout_console().print(table)


def _rows(r: dict) -> list[tuple[str, str]]:
    """The report as labelled, explained rows (``--json`` has the raw numbers)."""
    def n(v) -> str:
        return "unknown" if v is None else f"{v:,}"

    rows = [
        ("requests", n(r["requests"])),
        ("input tokens", n(r["input_tokens"])),
        ("  from the prompt cache (hit)", n(r["cache_hit_tokens"])),
        ("  computed (miss)", n(r["cache_miss_tokens"])),
        ("cache hit rate", f"{100 * r['cache_hit_rate']:.1f}%"),
        ("output tokens", n(r["output_tokens"])),
        ("batch lines (/v1/batches)", n(r["batch_requests"])),
        ("  their input / output tokens", f"{n(r['batch_input_tokens'])} / {n(r['batch_output_tokens'])}"),
        ("output tokens/s per request (mean)", n(r["avg_output_tokens_per_s"])),
        ("KV length per request (mean tokens)", n(r["avg_kv_length"])),
        ("serving nodes: peak / mean", f"{n(r['serving_nodes_peak'])} / {n(r['serving_nodes_avg'])}"),
        ("node-hours", n(r["node_hours"])),
        ("node-hours lent to training", n(r["lent_node_hours"])),
        ("revenue at --price-* (per 1M tokens)", f"{r['revenue']:,.4f}"),
        ("  of which batch lines (at --batch-discount)", f"{r['batch_revenue']:,.4f}"),
        ("cost: node-hours x --node-hour-cost", "unknown" if r["cost"] is None else f"{r['cost']:,.4f}"),
    ]
    margin = r["margin"]
    if margin is None:
        rows.append(("margin: (revenue - cost) / revenue", "unknown (no revenue or no node samples)"))
    else:
        note = "" if margin >= 0 else f" (cost is {1 - margin:,.1f}x the revenue)"
        rows.append(("margin: (revenue - cost) / revenue", f"{100 * margin:,.1f}%{note}"))
    return rows
