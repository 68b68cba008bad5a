"""``tide generate``: the model through the engine in-process (no Ray, no cache)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from deploy.options import check_checkpoint, check_device, check_dtype

__all__ = ["generate"]


def _load_with_progress(ckpt: Path, dtype: str, load_model, device: str = "cpu", mtp: bool = False):
    """Load a checkpoint showing its progress (shards, bytes, ETA) on stderr when that is a
    terminal (the bar disappears when done)."""
    from deploy.term import progress

    with progress(f"loading {ckpt}", None) as bar:
        return load_model(ckpt, dtype, device=device, mtp=mtp, progress=lambda p: bar.update(
            p.bytes, p.total_bytes, f"loading {ckpt}: shard {min(p.shards + 1, p.total_shards)}/{p.total_shards}"))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise typer.BadParameter("--prompt-ids is empty")
    return ids


def _parse_bias(values: list[str]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for v in values:
        token, sep, bias = v.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise typer.BadParameter(f"--logit-bias must be TOKEN_ID=BIAS, got {v!r}") from None
        if not sep:
            raise typer.BadParameter(f"--logit-bias must be TOKEN_ID=BIAS, got {v!r}")
    return tuple(pairs)


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
    presence_penalty: float = typer.Option(
        0.0, "--presence-penalty", help="lower a token's logit once it was generated ([-2, 2])"),
    frequency_penalty: float = typer.Option(
        0.0, "--frequency-penalty", help="lower a token's logit per time it was generated ([-2, 2])"),
    logit_bias: list[str] = typer.Option(
        None, "--logit-bias", help="TOKEN_ID=BIAS: add BIAS ([-100, 100]) to that token's logit; repeatable"),
    json_object: bool = typer.Option(False, "--json-object", help="JSON mode: the output is one JSON object"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (the Triton kernels run on CUDA)"),
    speculative_tokens: int = typer.Option(None, "--speculative-tokens", min=0, max=8,
                                           help="drafts per step from the checkpoint's MTP layers, where it has them "
                                                "(0: off; default: 1 with --device cuda, 0 on the CPU); the output "
                                                "is the same either way"),
    as_json: bool = typer.Option(False, "--json", help="print {token_ids, text} as JSON"),
) -> None:
    """Run the model through the engine in-process (no Ray, no cache) and print the text."""
    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    check_dtype(dtype)
    check_device(device)
    check_checkpoint(checkpoint)
    bias = _parse_bias(logit_bias or [])

    from cachedir.hashing import Namespace  # torch and the model: only once the arguments are good
    from cluster.engine import Engine, EngineConfig
    from cluster.request import GenerationRequest
    from model.checkpoint import CheckpointError, load_model
    from model.default import default_checkpoint
    from model.grammar import GrammarSpec
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                logit_bias=bias)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    ckpt = checkpoint or default_checkpoint()
    if speculative_tokens is None:  # where drafting pays (tide bench model --mtp-only)
        speculative_tokens = 1 if device == "cuda" else 0
    try:
        model = _load_with_progress(ckpt, dtype, load_model, device, mtp=speculative_tokens > 0)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
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
    bad = [t for t, _ in bias if t >= model.cfg.vocab_size]
    if bad:
        raise typer.BadParameter(f"--logit-bias token id {bad[0]} is outside the vocabulary [0, {model.cfg.vocab_size})")
    pages = -(-(len(ids) + max_tokens + speculative_tokens + 1) // 16)
    ns = Namespace(model.cfg.fingerprint(), "cli", dtype, "latent", 64)
    engine = Engine(model, EngineConfig(num_pages=pages, speculative_tokens=speculative_tokens), ns, tok.decode,
                    model.cfg.eos_token_id,
                    grammar_vocab=tok.grammar_vocab)
    try:
        engine.add_request(GenerationRequest("cli", tuple(ids), max_tokens, params,
                                             grammar=GrammarSpec("json_object") if json_object else None))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    outputs = engine.run_to_completion()["cli"]
    out = [t for o in outputs for t in o.new_token_ids]
    text = "".join(o.text for o in outputs)
    if as_json:
        sys.stdout.write(json.dumps({"token_ids": out, "text": text}) + "\n")
    else:
        typer.echo(text)
