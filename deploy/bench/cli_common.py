"""What the ``tide bench`` commands share: one JSON object on stdout, an optional plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


PLOT = typer.Option(None, "--plot", help="also draw the figures into this file (.png/.svg/.pdf; needs matplotlib: "
                                         "tideserve[plot])")


def check_plot(plot: Path | None) -> None:
    from deploy.bench.plots import check_plot_path

    if plot is not None:
        try:
            check_plot_path(plot)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None


def plotted(name: str, result: dict, plot: Path | None) -> dict:
    """``result`` drawn into ``plot`` (``deploy.bench.plots``), which the JSON then names."""
    if plot is None:
        return result
    from deploy.bench.plots import PLOTS

    try:
        PLOTS[name](result, plot)
    except ImportError as e:
        raise typer.BadParameter(str(e)) from None
    return {**result, "plot": str(plot)}


FAMILIES = ("v3", "v3.2", "v4")


def family_name(family: str) -> str:
    if family not in FAMILIES:
        raise typer.BadParameter(f"--family {family!r} is not one of {', '.join(FAMILIES)}")
    return family


def ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{option} {text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{option} {text!r} must list positive integers")
    return values
