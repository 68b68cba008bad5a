"""``tide bench model``: prefill and decode throughput of tideserve's model vs transformers."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import load_config, named_config
from model.model import DeepseekModel

PREFILL_TOKENS = 2048
DECODE_CONTEXT = 256
DECODE_BATCHES = (1, 8, 32)


Case = Callable[[], float]  # runs once; returns the seconds that count


def _timed(fn: Callable[[], object]) -> Case:
    def case() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return case


def _our_cases(model: DeepseekModel, steps: int) -> dict[str, Case]:
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (PREFILL_TOKENS,), generator=gen)
    pool = model.new_pool(PREFILL_TOKENS // 16, 16)
    table = torch.arange(PREFILL_TOKENS // 16)
    cases = {"prefill": _timed(lambda: model.prefill(ids, pool, table))}
    for b in DECODE_BATCHES:
        pages_per_seq = -(-(DECODE_CONTEXT + steps + 1) // 16)
        pool_b = model.new_pool(b * pages_per_seq, 16)
        tables = torch.arange(b * pages_per_seq).view(b, pages_per_seq)
        ctx = torch.randint(0, vocab, (b, DECODE_CONTEXT), generator=gen)
        for j in range(b):
            model.prefill(ctx[j], pool_b, tables[j])
        tok = torch.randint(0, vocab, (b,), generator=gen)

        def run(b=b, pool_b=pool_b, tables=tables, tok=tok) -> None:
            for s in range(steps):
                model.decode(tok, pool_b, tables, torch.full((b,), DECODE_CONTEXT + s))

        cases[f"decode_{b}"] = _timed(run)
    return cases


def _hf_cases(ckpt: Path, steps: int) -> dict[str, Case] | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PREFILL_TOKENS), generator=gen)

    def prefill() -> float:
        with torch.inference_mode():
            return _timed(lambda: hf(ids, logits_to_keep=1))()

    cases: dict[str, Case] = {"prefill": prefill}
    for b in DECODE_BATCHES:
        ctx = torch.randint(0, vocab, (b, DECODE_CONTEXT), generator=gen)
        tok = torch.randint(0, vocab, (b, 1), generator=gen)

        def decode(ctx=ctx, tok=tok) -> float:
            with torch.inference_mode():
                past = hf(ctx, use_cache=True).past_key_values  # the context: not timed
                t0 = time.perf_counter()
                for _ in range(steps):
                    past = hf(tok, past_key_values=past, use_cache=True).past_key_values
                return time.perf_counter() - t0

        cases[f"decode_{b}"] = decode
    return cases


def _best_interleaved(engines: list[dict[str, Case]], repeats: int) -> list[dict[str, float]]:
    """Fastest of ``repeats`` runs of every case (after one warm-up run), the engines taking
    turns on each case, so that a noisy machine's drift hits them alike."""
    best: list[dict[str, float]] = [{} for _ in engines]
    for name in engines[0]:
        for cases in engines:
            cases[name]()
        for _ in range(repeats):
            for i, cases in enumerate(engines):
                best[i][name] = min(best[i].get(name, float("inf")), cases[name]())
    return best


def _rates(best: dict[str, float], steps: int) -> tuple[float, dict[str, float]]:
    decode = {str(b): round(b * steps / best[f"decode_{b}"], 1) for b in DECODE_BATCHES}
    return round(PREFILL_TOKENS / best["prefill"], 1), decode


def run_model_bench(
    checkpoint: Path | None, steps: int = 16, repeats: int = 2, with_hf: bool = True
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            cfg = named_config("bench")
            checkpoint = save_checkpoint(Path(tmp) / "bench", cfg, random_state_dict(cfg, seed=0))
        cfg = load_config(checkpoint)
        engines = [_our_cases(load_model(checkpoint), steps)]
        hf = _hf_cases(checkpoint, steps) if with_hf else None
        if hf is not None:
            engines.append(hf)
        best = _best_interleaved(engines, repeats)
        prefill, decode = _rates(best[0], steps)
        result: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "threads": torch.get_num_threads(),
            "prefill_prompt_tokens": PREFILL_TOKENS,
            "decode_context_tokens": DECODE_CONTEXT,
            "decode_steps": steps,
            "repeats": repeats,
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode,
        }
        if hf is not None:
            hf_prefill, hf_decode = _rates(best[1], steps)
            result["hf_prefill_tokens_per_s"] = hf_prefill
            result["hf_decode_tokens_per_s"] = hf_decode
            result["prefill_speedup_vs_hf"] = round(prefill / hf_prefill, 2)
            result["decode_speedup_vs_hf"] = {b: round(decode[b] / hf_decode[b], 2) for b in decode}
        result["model_type"] = cfg.model_type
    return result
