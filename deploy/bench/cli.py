"""``tide bench``: benchmark commands. Each prints one JSON object on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks; each prints one JSON object.", no_args_is_help=True)


def _emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


@bench_app.command("model")
def bench_model(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the bench config, random weights"),
    steps: int = typer.Option(16, "--steps", min=1, help="decode steps per measurement"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="timed repeats (the fastest counts)"),
    no_hf: bool = typer.Option(False, "--no-hf", help="skip the transformers comparison"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Prefill (2,048-token prompt) and decode (batch 1/8/32, 256-token context) tokens/s,
    beside transformers on the same checkpoint and threads when it is installed."""
    from deploy.bench.model_bench import run_model_bench

    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise typer.BadParameter(f"--checkpoint {str(checkpoint)!r} has no config.json")
    _emit(run_model_bench(checkpoint, steps=steps, repeats=repeats, with_hf=not no_hf))
