"""``tide bench model``'s ``mtp`` section: decode tokens/s through the engine with and without the
checkpoint's MTP drafts, at batch 1, 2, 4, 8 and 32 (where drafting stops paying), in the same
run, with the drafts' acceptance.

The requests are chats asking for the documentation of standard-library names (what the
``tiny`` model was trained on; any checkpoint's tokenizer renders them), greedy, EOS ignored so
every request decodes ``tokens`` tokens. One timed run prefills the batch untimed, then decodes
it to the end; drafting and not drafting take turns run by run, the median of ``repeats`` counts.

Where the time goes, per engine step (medians): ``step_us`` the whole step, ``pass_us`` its call
of the model (the pass's inputs and the forward pass: the decode pass, or with drafts the verify
pass, which on the C++ path also runs MTP layer 0), the rest the engine's own work (scheduling,
sampling, detokenizing, the drafts' bookkeeping). Drafting pays where a step's tokens
(``tokens_per_step_with``) exceed what a drafting step costs in plain steps
(``step_cost_ratio``); the speedup is about their quotient.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from cachedir.hashing import Namespace
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from model.sampling import SamplingParams

__all__ = ["MTP_BATCHES", "mtp_decode_bench"]

MTP_BATCHES = (1, 2, 4, 8, 32)


def _prompts(tokenizer, n: int) -> list[tuple[int, ...]]:
    from model.train import stdlib_documents

    names = [name for name, _ in stdlib_documents(limit=4 * n)][::4][:n]
    return [tuple(tokenizer.apply_chat_template([{"role": "user", "content": name}])) for name in names]


def _run(model, prompts: list[tuple[int, ...]], tokens: int, drafts: int) -> tuple[float, int, Engine, int]:
    """(seconds decoding, tokens decoded, the engine, engine steps) for one batch run to its end."""
    pages = len(prompts) * -(-(max(map(len, prompts)) + tokens + drafts + 2) // 16)
    ns = Namespace(model.cfg.fingerprint(), "bench", str(model.dtype), "latent", 64)
    engine = Engine(model, EngineConfig(num_pages=pages, max_num_seqs=len(prompts), prefix_sharing=False,
                                        max_prefill_tokens=sum(map(len, prompts)), itl_factor=0.0,
                                        speculative_tokens=drafts, speculative_max_batch=len(prompts)),
                    ns, lambda ids: "", eos_id=None)
    for j, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{j}", prompt, tokens, SamplingParams()))
    while engine.waiting:
        engine.step()
    done, steps = engine.stats["decode_tokens"], 0
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, engine.stats["decode_tokens"] - done, engine, steps


def mtp_decode_bench(checkpoint: Path, tokens: int = 64, repeats: int = 5, drafts: int = 1,
                     batches: tuple[int, ...] = MTP_BATCHES, device: str = "cpu",
                     dtype: str = "float32") -> dict[str, Any]:
    """Per batch size: tokens/s with and without drafts (median, and the range of the runs), the
    speedup, and the drafts' acceptance per position; the model on ``device`` in ``dtype`` (on
    CUDA each engine replays its decode and verify steps as CUDA graphs, as a replica does)."""
    from model.checkpoint import load_model
    from model.tokenizer import load_tokenizer

    model = load_model(checkpoint, dtype, device=device, mtp=True)
    if not model.mtp:
        return {"available": False, "why": f"{checkpoint} has no MTP layers (config num_nextn_predict_layers)"}
    tokenizer = load_tokenizer(checkpoint)
    out: dict[str, Any] = {"available": True, "device": device, "dtype": dtype, "drafts_per_step": drafts,
                           "tokens_per_request": tokens, "repeats": repeats, "statistic": "median"}
    for b in batches:
        prompts = _prompts(tokenizer, b)
        for k in (0, drafts):  # warm-up: kernels, the C++ steps of this many rows
            _run(model, prompts, 8, k)
        times: dict[int, list[float]] = {0: [], drafts: []}
        step_us: dict[int, list[float]] = {0: [], drafts: []}
        pass_us: dict[int, list[float]] = {0: [], drafts: []}
        accepted = drafted = 0
        acceptance: list[float] = []
        for _ in range(repeats):
            for k in (0, drafts):
                took, n, engine, steps = _run(model, prompts, tokens, k)
                times[k].append(n / took)
                step_us[k].append(1e6 * took / steps)
                pass_us[k].append(1e6 * (engine.scheduler.decode_s(b) or 0.0))
                if k:
                    stats = engine.spec.stats
                    drafted += stats.drafted[0]
                    accepted += sum(stats.accepted)
                    acceptance = stats.acceptance()
        off, on = statistics.median(times[0]), statistics.median(times[drafts])
        steps_off, steps_on = statistics.median(step_us[0]), statistics.median(step_us[drafts])
        out[str(b)] = {
            "tokens_per_s_without": round(off, 1), "tokens_per_s_with": round(on, 1),
            "range_without": [round(min(times[0]), 1), round(max(times[0]), 1)],
            "range_with": [round(min(times[drafts]), 1), round(max(times[drafts]), 1)],
            "speedup": round(on / off, 2),
            "acceptance_per_position": [round(a, 3) for a in acceptance],
            "tokens_per_step_with": round(1 + accepted / max(1, drafted), 2),
            "step_us_without": round(steps_off, 1), "step_us_with": round(steps_on, 1),
            "pass_us_without": round(statistics.median(pass_us[0]), 1),
            "pass_us_with": round(statistics.median(pass_us[drafts]), 1),
            "step_cost_ratio": round(steps_on / steps_off, 2),
        }
    return out
