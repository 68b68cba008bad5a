"""``tide bench cluster|eplb|engine --plot FILE``: the figures people compare by eye, drawn from
the benchmark's own JSON with matplotlib (an optional extra: ``pip install 'tideserve[plot]'``).

cluster: token hit rate and TTFT p50 per mode (the night's cases), medians with their range over
the repeats; a row per scenario.
eplb: out-of-sample imbalance (the next window, sampled batches) per policy and Zipf exponent,
beside the placement in expert order and the sampling floor.
engine: host milliseconds per decode step against context, a line per batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["PLOTS", "check_plot_path", "plot_cluster", "plot_engine", "plot_eplb"]

SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(path: Path) -> None:
    """``ValueError`` naming the file unless it ends in a suffix matplotlib writes."""
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--plot {str(path)!r}: the file must end in .png, .svg or .pdf")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'tideserve[plot]'") from e
    return plt


@contextlib.contextmanager
def _figure(path: Path, title: str, *grid: int, **options) -> Iterator:
    """The axes of a new figure (``plt.subplots(*grid, **options)``), titled and saved into
    ``path`` when the block ends without an error; closed either way."""
    plt = _pyplot()
    fig, axes = plt.subplots(*grid, **options)
    try:
        yield axes
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _spread(figure: dict) -> tuple[float, float, float]:
    """(median, below, above) of a ``{"median", "range": [lo, hi]}`` figure (error bar lengths)."""
    median = figure.get("median") or 0.0
    lo, hi = figure.get("range") or (median, median)
    return median, median - lo, hi - median


def plot_cluster(out: dict[str, Any], path: Path) -> None:
    scenarios = out.get("scenarios") or {out.get("scenario", "trace"): out}  # a row of two plots each
    first = next(iter(scenarios.values()))
    title = (f"tide bench cluster: {first.get('requests')} requests x {first.get('repeats')} runs, "
             f"{first.get('nodes', '?')} nodes (median, range)")
    with _figure(path, title, len(scenarios), 2, figsize=(11, 4.5 * len(scenarios)), squeeze=False) as axes:
        for (name, result), (hit_ax, ttft_ax) in zip(scenarios.items(), axes, strict=True):
            modes = [m for m, v in result.items() if isinstance(v, dict) and "token_hit_rate" in v]
            for ax, key, label, scale in ((hit_ax, "token_hit_rate", "token hit rate (%)", 100.0),
                                          (ttft_ax, "ttft_p50_ms", "TTFT p50 (ms)", 1.0)):
                figures = [_spread(result[m][key]) for m in modes]
                ax.bar(modes, [f[0] * scale for f in figures], color="#3182bd",
                       yerr=[[f[1] * scale for f in figures], [f[2] * scale for f in figures]], capsize=4)
                ax.set_ylabel(label)
                ax.set_title(name, fontsize="medium")
                ax.tick_params(axis="x", labelrotation=15)


def plot_eplb(out: dict[str, Any], path: Path) -> None:
    results = out["results"]
    exponents = sorted({r["exponent"] for r in results})
    policies = list(dict.fromkeys(r["policy"] for r in results))
    title = f"tide bench eplb: {out['experts']} experts, {out['shards']} shards, {out['slots']} slots"
    with _figure(path, title, 1, len(exponents), figsize=(4.5 * len(exponents), 4.5), sharey=True,
                 squeeze=False) as axes:
        for ax, s in zip(axes[0], exponents, strict=True):
            rows = {r["policy"]: r for r in results if r["exponent"] == s}
            xs = range(len(policies))
            ax.bar([x - 0.2 for x in xs], [rows[p]["imbalance_next_window"] for p in policies], width=0.4,
                   label="next window", color="#3182bd")
            ax.bar([x + 0.2 for x in xs], [rows[p]["imbalance_sampled_batch"] for p in policies], width=0.4,
                   label="sampled batches", color="#9ecae1")
            ax.axhline(rows[policies[0]]["imbalance_next_window_before"], color="#de2d26", linestyle="--",
                       label="experts in order")
            ax.axhline(out["imbalance_sampled_floor"], color="#636363", linestyle=":", label="sampling floor")
            ax.set_xticks(list(xs), policies)
            ax.set_title(f"Zipf exponent {s:g}")
        axes[0][0].set_ylabel("max / mean load per shard (out of sample)")
        axes[0][0].legend(fontsize="small")


def plot_engine(out: dict[str, Any], path: Path) -> None:
    with _figure(path, "tide bench engine: the step's host work", figsize=(7, 4.5)) as ax:
        for batch, row in out["host_ms_per_step"].items():
            contexts = sorted(row, key=lambda c: int(c.removeprefix("ctx_")))
            ax.plot([int(c.removeprefix("ctx_")) for c in contexts], [row[c]["median_ms"] for c in contexts],
                    marker="o", label=batch.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel("host ms per decode step (median)")
        ax.legend(fontsize="small")


PLOTS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "cluster": plot_cluster, "eplb": plot_eplb, "engine": plot_engine}
