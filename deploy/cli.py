"""``tide``: the tideserve command line.

Every command validates its arguments at the edge and names the bad value; ``--json`` commands
print exactly one JSON object on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from deploy.bench.cli import bench_app

app = typer.Typer(
    help="tideserve: serve DeepSeek-style models (MLA + MoE) on Ray with a disk prompt cache.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise typer.BadParameter("--prompt-ids is empty")
    return ids


@app.command()
def generate(
    checkpoint: Path = typer.Option(
        None, "--checkpoint", help="HF checkpoint directory (config.json + safetensors); default: the built-in 'tiny' model"
    ),
    prompt: str = typer.Option(None, "--prompt", help="prompt text (tokenized with the checkpoint's tokenizer)"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3"),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="tokens to generate"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(None, "--seed"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    as_json: bool = typer.Option(False, "--json", help="print {token_ids, text} as JSON"),
) -> None:
    """Run the model in-process (no Ray, no cache) and print the generated text."""
    from model.checkpoint import DTYPES, CheckpointError, load_model
    from model.default import default_checkpoint
    from model.generate import generate as run_generate
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if checkpoint is not None and not checkpoint.is_dir():
        raise typer.BadParameter(f"--checkpoint {str(checkpoint)!r} is not a directory")
    ckpt = checkpoint or default_checkpoint()
    try:
        model = load_model(ckpt, dtype)
    except (CheckpointError, FileNotFoundError) as e:
        typer.echo(f"error: cannot load {ckpt}: {e}", err=True)
        raise typer.Exit(2) from None
    tok = load_tokenizer(ckpt)
    if prompt is not None:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
    else:
        ids = _parse_ids(prompt_ids)
        bad = [i for i in ids if not 0 <= i < model.cfg.vocab_size]
        if bad:
            raise typer.BadParameter(f"token id {bad[0]} is outside the vocabulary [0, {model.cfg.vocab_size})")
    try:
        out = run_generate(model, ids, max_tokens, params, eos_id=model.cfg.eos_token_id)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    text = tok.decode(out)
    if as_json:
        sys.stdout.write(json.dumps({"token_ids": out, "text": text}) + "\n")
    else:
        typer.echo(text)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
