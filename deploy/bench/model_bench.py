"""``tide bench model``: prefill and decode throughput of tideserve's model vs transformers."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import load_config, named_config
from model.model import DeepseekModel

PREFILL_TOKENS = 2048
DECODE_CONTEXT = 256
DECODE_BATCHES = (1, 8, 32)


def _best(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _ours(model: DeepseekModel, steps: int, repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (PREFILL_TOKENS,), generator=gen)
    pool = model.new_pool(PREFILL_TOKENS // 16, 16)
    table = torch.arange(PREFILL_TOKENS // 16)
    prefill_s = _best(lambda: model.prefill(ids, pool, table), repeats)
    decode = {}
    for b in DECODE_BATCHES:
        pages_per_seq = -(-(DECODE_CONTEXT + steps + 1) // 16)
        pool = model.new_pool(b * pages_per_seq, 16)
        tables = torch.arange(b * pages_per_seq).view(b, pages_per_seq)
        ctx = torch.randint(0, vocab, (b, DECODE_CONTEXT), generator=gen)
        for j in range(b):
            model.prefill(ctx[j], pool, tables[j])
        tok = torch.randint(0, vocab, (b,), generator=gen)

        def run() -> None:
            for s in range(steps):
                model.decode(tok, pool, tables, torch.full((b,), DECODE_CONTEXT + s))

        decode[str(b)] = round(b * steps / _best(run, repeats), 1)
    return {"prefill_tokens_per_s": round(PREFILL_TOKENS / prefill_s, 1), "decode_tokens_per_s": decode}


def _hf(ckpt: Path, steps: int, repeats: int) -> dict[str, Any] | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PREFILL_TOKENS), generator=gen)
    with torch.inference_mode():
        prefill_s = _best(lambda: hf(ids, logits_to_keep=1), repeats)
        decode = {}
        for b in DECODE_BATCHES:
            ctx = torch.randint(0, vocab, (b, DECODE_CONTEXT), generator=gen)
            tok = torch.randint(0, vocab, (b, 1), generator=gen)

            def run() -> None:
                past = hf(ctx, use_cache=True).past_key_values  # not timed separately: see below
                t0 = time.perf_counter()
                for _ in range(steps):
                    past = hf(tok, past_key_values=past, use_cache=True).past_key_values
                run.elapsed = time.perf_counter() - t0  # type: ignore[attr-defined]

            best = float("inf")
            run()
            for _ in range(repeats):
                run()
                best = min(best, run.elapsed)  # type: ignore[attr-defined]
            decode[str(b)] = round(b * steps / best, 1)
    return {"hf_prefill_tokens_per_s": round(PREFILL_TOKENS / prefill_s, 1), "hf_decode_tokens_per_s": decode}


def run_model_bench(
    checkpoint: Path | None, steps: int = 16, repeats: int = 2, with_hf: bool = True
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            cfg = named_config("bench")
            checkpoint = save_checkpoint(Path(tmp) / "bench", cfg, random_state_dict(cfg, seed=0))
        cfg = load_config(checkpoint)
        model = load_model(checkpoint)
        result: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "threads": torch.get_num_threads(),
            "prefill_prompt_tokens": PREFILL_TOKENS,
            "decode_context_tokens": DECODE_CONTEXT,
            "decode_steps": steps,
            **_ours(model, steps, repeats),
        }
        del model
        hf = _hf(checkpoint, steps, repeats) if with_hf else None
        if hf is not None:
            result.update(hf)
            result["prefill_speedup_vs_hf"] = round(
                result["prefill_tokens_per_s"] / hf["hf_prefill_tokens_per_s"], 2
            )
            result["decode_speedup_vs_hf"] = {
                b: round(result["decode_tokens_per_s"][b] / hf["hf_decode_tokens_per_s"][b], 2)
                for b in result["decode_tokens_per_s"]
            }
        result["model_type"] = cfg.model_type
    return result
