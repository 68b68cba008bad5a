"""``tide bench engine``: the engine's host work per decode step, apart from the model; and the
inter-token latency of running requests while a long prompt is prefilled.

The engine drives a model that costs nothing (``NullModel``: its forward returns ready logits,
its KV pool holds nothing), so a step's time is the engine's own work: scheduling, block tables,
sampling bookkeeping, detokenization, stop strings, outputs. Measured at batch 1/16/64/256 and
contexts 1K/8K/32K (every sequence holds that many tokens), after a warm-up: the lowest median
of three rounds of timed decode steps (a step's host work is a fraction of a millisecond, which
another process's burst of work on the machine would lift for a whole round) and the p90 of
all of them. The engine-core targets: at most 1 ms at batch 64, and at most
1.2x from 1K to 32K context at every batch.

``sampling``: the sampler alone (``model.sampling.sample``) on DeepSeek-V3's 129,280-token
vocabulary, by batch and mode (temperature alone, top-k 50, top-p 0.9), median of timed calls on
logits shaped like a language model's (a few likely tokens, a long tail).

``itl``: 16 requests decode on the bench config (random weights) while an 8K-token prompt is
prefilled; their inter-token latency (p50, p99) against their median without it (the 60 steps
before it came; their p90 and p99 show the machine's own jitter, which the p99 under the prompt
carries too), and the prompt's prefill time, with prefill chunks sized by ``itl_factor`` 2.5 (the serving default) and
3 and with fixed 2,048-token chunks (the decode tokens ride in each chunk's forward pass).
Target: the serving default's p99 at most 3x (``targets``); the other two are for comparison.
``small_model``: the same with one request decoding on the tiny config (the default model's)
and a 2,048-token prompt, with the serving default's ``itl_floor_ms`` and without it: a decode
step of a millisecond would cut the prompt into chunks of a few tokens.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from typing import Any

import torch

from cachedir.hashing import Namespace
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from model.config import named_config
from model.sampling import SamplingParams

BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 8192, 32768)
VOCAB = 512  # small, so the argmax over the logits (device work on a GPU) does not hide the host's


def byte_text(ids: list[int]) -> str:
    """Text of token ids read as bytes (ids past 255 have none): a cheap, real detokenizer."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class _NullPool:
    """A KV pool that holds nothing (the engine only passes it to the model here)."""

    def __init__(self, num_layers: int, latent_dim: int) -> None:
        self.num_layers, self.latent_dim, self.dtype = num_layers, latent_dim, torch.float32
        self.row_dim = latent_dim


class NullModel:
    """The model interface the engine uses, at no cost: prefill, decode and mixed return fixed
    logits [V] / [B, V] (greedy picks token ``token``), nothing is computed or stored."""

    def __init__(self, max_context: int, vocab: int = VOCAB, token: int = 7) -> None:
        self.cfg = dataclasses.replace(named_config("tiny"), vocab_size=vocab,
                                       max_position_embeddings=max_context)
        self._logits = torch.zeros(max(BATCHES), vocab)
        self._logits[:, token] = 1.0
        self.device = torch.device("cpu")

    def new_pool(self, num_pages: int, page_size: int = 16) -> _NullPool:
        return _NullPool(self.cfg.num_hidden_layers, self.cfg.latent_dim)

    def prefill(self, token_ids, pool, block_table, start: int = 0, **_) -> torch.Tensor:
        return self._logits[0]

    def decode(self, tokens, pool, tables, positions, **_) -> torch.Tensor:
        return self._logits[: tokens.shape[0]]

    def mixed(self, chunk_ids, chunk_table, chunk_start, tokens, tables, positions, pool, **_):
        return self._logits[0], self._logits[: tokens.shape[0]]


ROUNDS = 3  # timed rounds of a case: its median is the lowest round's (the machine's noise only adds time)


def host_ms_per_step(batch: int, context: int, steps: int = 30, warmup: int = 5,
                     stop: tuple[str, ...] = ("\n\n",)) -> dict[str, float]:
    """Milliseconds of a decode step of ``batch`` sequences that each hold ``context`` tokens
    (each request has a stop string, as chat clients send): the lowest of ``ROUNDS`` medians of
    ``steps`` steps (a burst of another process's work lifts one round, not the figure) and the
    p90 of all of them."""
    page = 16
    total = context + warmup + ROUNDS * steps + 2
    model = NullModel(total + 1)
    cfg = EngineConfig(num_pages=batch * -(-(total + 1) // page), page_size=page, max_num_seqs=batch,
                       max_prefill_tokens=context * batch, itl_factor=0.0)
    engine = Engine(model, cfg, Namespace(model.cfg.fingerprint(), "bench", "float32", "latent", 64),
                    byte_text, eos_id=None)
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = tuple(torch.randint(0, VOCAB, (context,), generator=gen).tolist())
        engine.add_request(GenerationRequest(f"r{i}", prompt, warmup + ROUNDS * steps + 2, SamplingParams(), stop=stop))
    while engine.waiting:  # every prompt admitted (the null model's prefill costs nothing)
        engine.step()
    assert len(engine.running) == batch, (len(engine.running), batch)
    for _ in range(warmup):
        engine.step()
    rounds = []
    for _ in range(ROUNDS):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        rounds.append(times)
    every = sorted(t for times in rounds for t in times)
    return {"median_ms": round(min(statistics.median(times) for times in rounds), 4),
            "p90_ms": round(every[int(0.9 * (len(every) - 1))], 4), "steps": steps, "rounds": ROUNDS}


SAMPLING_VOCAB = 129_280  # DeepSeek-V3's
SAMPLING_MODES = {"temperature": SamplingParams(temperature=0.7), "top_k_50": SamplingParams(temperature=0.7, top_k=50),
                  "top_p_0.9": SamplingParams(temperature=0.7, top_p=0.9)}


def sampling_ms(batch: int, repeats: int = 7) -> dict[str, float]:
    """Median ms of one ``sample`` call for ``batch`` rows in each mode."""
    from model.sampling import sample

    gen = torch.Generator().manual_seed(0)
    # a language model's logits: a Zipf-like fall over the ranks, in a random order
    ranks = torch.arange(1, SAMPLING_VOCAB + 1, dtype=torch.float32)
    logits = torch.stack([(-1.1 * ranks.log())[torch.randperm(SAMPLING_VOCAB, generator=gen)] * 3
                          for _ in range(batch)])
    out = {}
    for mode, params in SAMPLING_MODES.items():
        sample(logits, [params] * batch, [None] * batch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sample(logits, [params] * batch, [None] * batch)
            times.append((time.perf_counter() - t0) * 1000)
        out[mode] = round(statistics.median(times), 3)
    return out


def run_engine_bench(batches: tuple[int, ...] = BATCHES, contexts: tuple[int, ...] = CONTEXTS,
                     steps: int = 30) -> dict[str, Any]:
    grid: dict[str, dict[str, dict[str, float]]] = {}
    for b in batches:
        grid[f"batch_{b}"] = {f"ctx_{c}": host_ms_per_step(b, c, steps) for c in contexts}
    growth = {}
    for b in batches:
        row = grid[f"batch_{b}"]
        first, last = row[f"ctx_{contexts[0]}"]["median_ms"], row[f"ctx_{contexts[-1]}"]["median_ms"]
        growth[f"batch_{b}"] = round(last / first, 3) if first > 0 else None
    out: dict[str, Any] = {
        "host_ms_per_step": grid,
        "context_growth": growth,  # median at the longest context / at the shortest
        "sampling_ms": {f"batch_{b}": sampling_ms(b) for b in batches if b <= 64},
        "sampling_vocab": SAMPLING_VOCAB,
        "vocab": VOCAB, "machine": platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    if 64 in batches:
        b64 = grid["batch_64"]
        out["targets"] = {
            "batch_64_at_most_1ms": all(v["median_ms"] <= 1.0 for v in b64.values()),
            "growth_at_most_1.2x": all(g is not None and g <= 1.2 for g in growth.values()),
        }
    return out


def _itl(model, itl_factor: float, running: int, prompt_tokens: int, warm_steps: int,
         itl_floor_ms: float = 0.0) -> dict[str, Any]:
    """Inter-token latencies (ms) of ``running`` decoding requests before and while a
    ``prompt_tokens`` prompt is prefilled."""
    cfg = EngineConfig(num_pages=(running + 1) * -(-(prompt_tokens + 4096) // 16), max_num_seqs=running + 1,
                       itl_factor=itl_factor, itl_floor_ms=itl_floor_ms)
    engine = Engine(model, cfg, Namespace(model.cfg.fingerprint(), "bench", "float32", "latent", 64),
                    lambda ids: "", eos_id=None)
    gen = torch.Generator().manual_seed(0)
    for i in range(running):
        engine.add_request(GenerationRequest(f"d{i}", tuple(torch.randint(0, model.cfg.vocab_size, (64,), generator=gen).tolist()),
                                             4000, SamplingParams()))
    while engine.waiting:
        engine.step()
    last: dict[str, float] = {}
    gaps: list[float] = []

    def step() -> None:
        engine.step()
        now = time.perf_counter()
        for rid in (f"d{i}" for i in range(running)):
            if rid in last:
                gaps.append((now - last[rid]) * 1e3)
            last[rid] = now

    for _ in range(warm_steps):
        step()
    alone = sorted(gaps[running:])  # the first step's gaps include the admission
    gaps.clear()
    engine.add_request(GenerationRequest("long", tuple(torch.randint(0, model.cfg.vocab_size, (prompt_tokens,),
                                                                      generator=gen).tolist()), 1, SamplingParams()))
    t0 = time.perf_counter()
    while "long" in engine._by_id:
        step()
    prefill_s = time.perf_counter() - t0
    under = sorted(gaps)

    def q(ranked: list[float], f: float) -> float:  # the f-quantile of sorted values
        return ranked[min(len(ranked) - 1, int(f * len(ranked)))]

    alone_p50 = statistics.median(alone)
    return {"itl_factor": itl_factor, "itl_floor_ms": itl_floor_ms, "alone_p50_ms": round(alone_p50, 2),
            "alone_p90_ms": round(q(alone, 0.9), 2), "alone_p99_ms": round(q(alone, 0.99), 2),
            "under_prefill_p50_ms": round(statistics.median(under), 2),
            "under_prefill_p99_ms": round(q(under, 0.99), 2),
            "p99_over_alone_p50": round(q(under, 0.99) / alone_p50, 2),
            "prefill_s": round(prefill_s, 2), "steps": len(under) // running}


SERVING_ITL_FACTOR = 2.5  # AppArgs.itl_factor's default (a test ties them)
SERVING_ITL_FLOOR_MS = 10.0  # AppArgs.itl_floor_ms's default (likewise)
ITL_FACTORS = (SERVING_ITL_FACTOR, 3.0)


def run_itl_bench(running: int = 16, prompt_tokens: int = 8000, warm_steps: int = 60,
                  factors: tuple[float, ...] = ITL_FACTORS, small_prompt_tokens: int = 2048) -> dict[str, Any]:
    from model.checkpoint import build_model, random_state_dict

    cfg = named_config("bench")
    model = build_model(cfg, random_state_dict(cfg, seed=0))
    out: dict[str, Any] = {"running": running, "prompt_tokens": prompt_tokens, "config": "bench"}
    runs = {f"sized_chunks_{f:g}": f for f in factors} | {"fixed_2048_chunks": 0.0}
    for name, f in runs.items():
        out[name] = _itl(model, f, running, prompt_tokens, warm_steps, SERVING_ITL_FLOOR_MS if f else 0.0)
    if SERVING_ITL_FACTOR in factors:  # the target is the serving default's; the others compare
        out["targets"] = {"serving_default_p99_at_most_3x":
                          out[f"sized_chunks_{SERVING_ITL_FACTOR:g}"]["p99_over_alone_p50"] <= 3.0}
    tiny = named_config("tiny")
    small = build_model(tiny, random_state_dict(tiny, seed=0))
    out["small_model"] = {"config": "tiny", "running": 1, "prompt_tokens": small_prompt_tokens} | {
        name: _itl(small, factor, 1, small_prompt_tokens, warm_steps, floor)
        for name, factor, floor in (("serving_default", SERVING_ITL_FACTOR, SERVING_ITL_FLOOR_MS),
                                    ("no_floor", SERVING_ITL_FACTOR, 0.0), ("fixed_2048_chunks", 0.0, 0.0))}
    return out
