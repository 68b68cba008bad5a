"""``tide stats --plot``: DeepSeek's daily chart of this cluster, with matplotlib (an optional
extra: ``pip install 'tideserve[plot]'``). Serving nodes as a step line over the window, input
and output tokens per slice as bars, the cache hit rate on its own axis."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

__all__ = ["plot_timeline"]


def plot_timeline(series: dict, path: Path, timezone: str = "UTC", title: str = "tideserve") -> None:
    """Draw ``cluster.daily_report.timeline``'s ``series`` into ``path`` (PNG, SVG or PDF by its
    suffix). ``ImportError`` names the extra when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'tideserve[plot]'") from e

    tz = ZoneInfo(timezone)
    starts = [datetime.fromtimestamp(t, tz) for t in series["start_s"]]
    width = series["width_s"] / 86400  # matplotlib's date unit is a day
    fig, (tokens_ax, nodes_ax) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(3, 2))
    try:
        inputs = [i / 1e6 for i in series["input_tokens"]]
        hits = [h / 1e6 for h in series["cache_hit_tokens"]]
        tokens_ax.bar(starts, inputs, width=width * 0.9, align="edge", color="#9ecae1", label="input tokens")
        tokens_ax.bar(starts, hits, width=width * 0.9, align="edge", color="#3182bd", label="of which cache hits")
        tokens_ax.bar(starts, [o / 1e6 for o in series["output_tokens"]], width=width * 0.45, align="edge",
                      color="#fd8d3c", label="output tokens")
        batch = [(i + o) / 1e6 for i, o in zip(series["batch_input_tokens"], series["batch_output_tokens"], strict=True)]
        if any(batch):
            tokens_ax.bar(starts, batch, width=width * 0.25, align="edge", color="#636363",
                          label="of which batch (input + output)")
        tokens_ax.set_ylabel("tokens per slice (millions)")
        rate_ax = tokens_ax.twinx()
        rates = [None if r is None else 100 * r for r in series["cache_hit_rate"]]
        rate_ax.plot([s for s, r in zip(starts, rates, strict=True) if r is not None],
                     [r for r in rates if r is not None], color="#31a354", marker="o", label="cache hit rate")
        rate_ax.set_ylim(0, 100)
        rate_ax.set_ylabel("cache hit rate (%)")
        handles = tokens_ax.get_legend_handles_labels()[0] + rate_ax.get_legend_handles_labels()[0]
        tokens_ax.legend(handles=handles, loc="upper left", fontsize="small")
        top = 0
        for key, color, label in (("serving_nodes", "#756bb1", "serving (interactive and batch)"),
                                  ("lent_nodes", "#e6550d", "lent to training")):
            known = [(s, n) for s, n in zip(starts, series[key], strict=True) if n is not None]
            if known:
                xs = [s for s, _ in known] + [datetime.fromtimestamp(series["start_s"][-1] + series["width_s"], tz)]
                ys = [n for _, n in known] + [known[-1][1]]
                nodes_ax.step(xs, ys, where="post", color=color, label=label)
                top = max(top, *ys)
        nodes_ax.set_ylim(0, top + 1)
        nodes_ax.legend(loc="upper left", fontsize="small")
        nodes_ax.set_ylabel("nodes")
        nodes_ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=tz))
        nodes_ax.set_xlabel(f"time ({timezone})")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
