"""``tide bench model``: prefill and decode throughput of tideserve's model vs transformers.

Decode is measured twice for tideserve: ``model.decode`` alone (``decode_tokens_per_s``) and
through ``Engine.step`` (``engine_decode_tokens_per_s``: scheduling, block tables, sampling,
detokenizing and outputs included), the way a replica serves. Every figure is the median of
``repeats`` timed runs (after one warm-up), the engines taking turns case by case, with the
range of the runs beside it. ``decode_mixed_*`` decode a batch of 8 whose contexts differ (32
to 480 tokens, 256 on average): tideserve runs them ragged, transformers as a left-padded batch
with an attention mask, as its users batch them.

``int8``: the same cases with the weights held in int8 with a scale per 128 columns
(``cpu_weights="int8"``, ``model.quant``), taking turns with fp32: tokens/s, speedups and the
bytes the weights take.

Decode on CPU is bound by streaming weights, so ``roofline_fraction`` puts each decode figure
against the machine: the bytes a step must read (every weight once, the routed experts a batch of
that size is expected to touch under uniform routing, the embedding rows of its tokens and the
batch's latent KV) at that step rate, over the streaming read bandwidth measured in the same run
(``stream_read_gb_per_s``: summing a buffer far larger than the caches, with the same threads)."""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cachedir.hashing import Namespace
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from deploy.bench.engine_bench import byte_text
from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import ModelConfig, load_config, named_config
from model.kv_sizes import kv_sizes
from model.model import DeepseekModel
from model.v4.config import CSA, HCA, V4Config

BENCH_CONFIGS = {"v3": "bench", "v3.2": "bench-v3.2", "v4": "bench-v4"}  # --family: its bench config

PREFILL_TOKENS = 2048
DECODE_CONTEXT = 256
DECODE_BATCHES = (1, 8, 32)
MIXED_BATCHES = (8,)  # batches of mixed context lengths


def contexts(batch: int, mixed: bool) -> list[int]:
    """Each row's context: DECODE_CONTEXT, or evenly from 32 to 2 x DECODE_CONTEXT - 32 (the
    same mean) when ``mixed``."""
    if not mixed or batch == 1:
        return [DECODE_CONTEXT] * batch
    lo, hi = 32, 2 * DECODE_CONTEXT - 32
    return [lo + (hi - lo) * j // (batch - 1) for j in range(batch)]


def _cases_of(batches: tuple[int, ...], mixed: bool) -> list[tuple[str, int, list[int]]]:
    tag = "mixed_" if mixed else ""
    return [(f"{tag}{b}", b, contexts(b, mixed)) for b in batches]


CASES = _cases_of(DECODE_BATCHES, False) + _cases_of(MIXED_BATCHES, True)  # (name suffix, batch, contexts)


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
    for name, b, ctx_lens in CASES:
        pages_per_seq = -(-(max(ctx_lens) + steps + 1) // 16)
        pool_b = model.new_pool(b * pages_per_seq, 16)
        tables = torch.arange(b * pages_per_seq).view(b, pages_per_seq)
        for j, n in enumerate(ctx_lens):
            model.prefill(torch.randint(0, vocab, (n,), generator=gen), pool_b, tables[j])
        tok = torch.randint(0, vocab, (b,), generator=gen)
        start = torch.tensor(ctx_lens)

        def run(pool_b=pool_b, tables=tables, tok=tok, start=start) -> None:
            for s in range(steps):
                model.decode(tok, pool_b, tables, start + s)

        cases[f"decode_{name}"] = _timed(run)
        cases[f"engine_decode_{name}"] = _engine_decode(model, ctx_lens, steps)
    return cases


def _engine_decode(model: DeepseekModel, ctx_lens: list[int], steps: int) -> Case:
    """``steps`` engine steps of one running request per context length (greedy prompts of
    those lengths, prefilled untimed on a fresh engine each run)."""
    batch = len(ctx_lens)
    pages_per_seq = -(-(max(ctx_lens) + steps + 3) // 16)
    ns = Namespace(model.cfg.fingerprint(), "bench", str(model.dtype), "latent", 64)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in ctx_lens]

    def run() -> float:
        engine = Engine(model, EngineConfig(num_pages=batch * pages_per_seq, max_num_seqs=batch, prefix_sharing=False,
                                            max_prefill_tokens=sum(ctx_lens), itl_factor=0.0),
                        ns, byte_text, eos_id=None)
        for j, prompt in enumerate(prompts):
            engine.add_request(GenerationRequest(f"r{j}", tuple(prompt), steps + 2))
        while engine.waiting:
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        took = time.perf_counter() - t0
        if engine.stats["decode_tokens"] != batch * steps:
            raise RuntimeError(f"the timed steps decoded {engine.stats['decode_tokens']} tokens, not {batch} x {steps}")
        return took

    return run


STREAM_BYTES = 512 << 20  # the bandwidth probe's buffer: far beyond any last-level cache


def stream_read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second a full read of a large float32 buffer reaches (median of ``repeats``)."""
    x = torch.ones(STREAM_BYTES // 4)
    x.sum()  # pages touched, threads started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return STREAM_BYTES / statistics.median(times)


def decode_step_bytes(checkpoint: Path, batch: int, context: int, itemsize: int) -> int:
    """Bytes one decode step of ``batch`` sequences of ``context`` tokens must read at least: all
    weights once (as loaded, ``itemsize`` bytes each), of each MoE layer's routed experts only the
    share a batch is expected to touch (1 - (1 - k/E)^batch under uniform routing), of the
    embedding only the batch's rows, and the batch's latent KV."""
    from safetensors import safe_open

    cfg = load_config(checkpoint)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = 1.0 - (1.0 - k / e) ** batch if e else 0.0
    weights = 0.0
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                if name.endswith(("embed_tokens.weight", "embed.weight")):
                    weights += batch * cfg.hidden_size
                elif ".mlp.experts." in name or ".ffn.experts." in name:
                    weights += numel * touched
                else:
                    weights += numel
    return int((weights + batch * decode_kv_values(cfg, context)) * itemsize)


def decode_kv_values(cfg: ModelConfig | V4Config, context: int) -> int:
    """KV values a decode step reads for one sequence of ``context`` tokens: every latent (and
    V3.2's indexer key) of every layer; V4's window rows and compressed entries."""
    if isinstance(cfg, ModelConfig):
        return context * cfg.num_hidden_layers * cfg.kv_dim
    window = cfg.num_hidden_layers * min(context, cfg.sliding_window) * cfg.head_dim
    csa = sum(t == CSA for t in cfg.layer_types) * (context // cfg.csa_ratio) * (cfg.head_dim + cfg.index_head_dim)
    hca = sum(t == HCA for t in cfg.layer_types) * (context // cfg.hca_ratio) * cfg.head_dim
    return window + csa + hca


def _roofline(checkpoint: Path, rates: dict[str, Any], bandwidth: float, itemsize: int) -> dict[str, dict[str, float]]:
    """Each decode figure's share of the streaming bandwidth (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("decode", "engine_decode", "decode_mixed", "engine_decode_mixed"):
        if f"{kind}_tokens_per_s" not in rates:
            continue
        out[kind] = {}
        for b, tokens_per_s in rates[f"{kind}_tokens_per_s"].items():
            steps_per_s = tokens_per_s / int(b)
            need = decode_step_bytes(checkpoint, int(b), DECODE_CONTEXT, itemsize)
            out[kind][b] = round(need * steps_per_s / bandwidth, 3)
    return out


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
    for name, b, ctx_lens in CASES:
        width = max(ctx_lens)
        ctx = torch.randint(0, vocab, (b, width), generator=gen)
        # a ragged batch as transformers users run one: left padding and an attention mask
        mask = torch.stack([torch.arange(width) >= width - n for n in ctx_lens]).long()
        tok = torch.randint(0, vocab, (b, 1), generator=gen)

        def decode(ctx=ctx, mask=mask, tok=tok) -> float:
            with torch.inference_mode():
                past = hf(ctx, attention_mask=mask, use_cache=True).past_key_values  # the context: not timed
                t0 = time.perf_counter()
                m = mask
                for _ in range(steps):
                    m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], 1)
                    past = hf(tok, attention_mask=m, past_key_values=past, use_cache=True).past_key_values
                return time.perf_counter() - t0

        cases[f"decode_{name}"] = decode
    return cases


def _interleaved(engines: list[dict[str, Case]], repeats: int) -> list[dict[str, list[float]]]:
    """Seconds of ``repeats`` runs of every case (after one warm-up run each), the engines
    taking turns on each case, so that a noisy machine's drift hits them alike."""
    runs: list[dict[str, list[float]]] = [{} for _ in engines]
    for name in engines[0]:
        having = [(i, cases) for i, cases in enumerate(engines) if name in cases]
        for _, cases in having:
            cases[name]()
        for _ in range(repeats):
            for i, cases in having:
                runs[i].setdefault(name, []).append(cases[name]())
    return runs


def _rates(runs: dict[str, list[float]], steps: int) -> dict[str, Any]:
    """Tokens/s of each case at the median run, and the range (slowest run, fastest run)."""

    def rate(tokens: int, name: str) -> tuple[float, list[float]]:
        times = runs[name]
        return round(tokens / statistics.median(times), 1), [round(tokens / max(times), 1), round(tokens / min(times), 1)]

    out: dict[str, Any] = {"prefill": rate(PREFILL_TOKENS, "prefill")}
    for kind in ("decode", "engine_decode"):
        for mixed, batches in ((False, DECODE_BATCHES), (True, MIXED_BATCHES)):
            key = f"{kind}_mixed" if mixed else kind
            tag = "mixed_" if mixed else ""
            if f"{kind}_{tag}{batches[0]}" in runs:
                out[key] = {str(b): rate(b * steps, f"{kind}_{tag}{b}") for b in batches}
    return out


def _split(rates: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """({figure: median tokens/s}, {figure: its range}) under the result's key names."""
    medians, ranges = {}, {}
    for kind, v in rates.items():
        key = f"{prefix}{kind}_tokens_per_s"
        if kind == "prefill":
            medians[key], ranges[key] = v
        else:
            medians[key] = {b: m for b, (m, _) in v.items()}
            ranges[key] = {b: r for b, (_, r) in v.items()}
    return medians, ranges


def run_model_bench(
    checkpoint: Path | None, steps: int = 16, repeats: int = 5, with_hf: bool = True, with_int8: bool = True,
    family: str = "v3",
) -> dict[str, Any]:
    """``with_int8``: the same cases with the model's weights held in int8 (``cpu_weights``),
    taking turns with fp32, under ``int8`` with their speedups and the weights' bytes (MLA
    families). ``family``: the bench config of that family without a checkpoint."""
    from model.quant import weight_bytes

    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            cfg = named_config(BENCH_CONFIGS[family])
            checkpoint = save_checkpoint(Path(tmp) / "bench", cfg, random_state_dict(cfg, seed=0))
        cfg = load_config(checkpoint)
        model = load_model(checkpoint)
        engines = [_our_cases(model, steps)]
        int8_ok = with_int8 and model.dtype == torch.float32 and isinstance(cfg, ModelConfig)
        q8 = load_model(checkpoint, cpu_weights="int8") if int8_ok else None
        if q8 is not None:
            engines.append(_our_cases(q8, steps))
        hf = _hf_cases(checkpoint, steps) if with_hf else None
        if hf is not None:
            engines.append(hf)
        runs = _interleaved(engines, repeats)
        ours, spread = _split(_rates(runs[0], steps))
        result: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(), "torch": torch.__version__,
            "prefill_prompt_tokens": PREFILL_TOKENS,
            "decode_context_tokens": DECODE_CONTEXT,
            "decode_mixed_context_tokens": {str(b): contexts(b, True) for b in MIXED_BATCHES},
            "decode_steps": steps,
            "repeats": repeats,
            "statistic": "median",
            **ours,
        }
        if q8 is not None:
            int8, int8_spread = _split(_rates(runs[1], steps))
            result["int8"] = {
                **int8, "range": int8_spread,
                "weight_bytes": weight_bytes(q8), "fp32_weight_bytes": weight_bytes(model),
                "speedup_vs_fp32": {kind: ({b: round(v / ours[kind][b], 2) for b, v in figs.items()}
                                           if isinstance(figs, dict) else round(figs / ours[kind], 2))
                                    for kind, figs in int8.items()},
            }
        if hf is not None:
            theirs, hf_spread = _split(_rates(runs[-1], steps), "hf_")
            result.update(theirs)
            spread.update(hf_spread)
            result["prefill_speedup_vs_hf"] = round(ours["prefill_tokens_per_s"] / theirs["hf_prefill_tokens_per_s"], 2)
            for kind in ("decode", "engine_decode", "decode_mixed", "engine_decode_mixed"):
                hf_key = "hf_decode_mixed_tokens_per_s" if kind.endswith("mixed") else "hf_decode_tokens_per_s"
                result[f"{kind}_speedup_vs_hf"] = {
                    b: round(v / theirs[hf_key][b], 2) for b, v in ours[f"{kind}_tokens_per_s"].items()}
        result["range"] = spread  # tokens/s of the slowest and the fastest run
        bandwidth = stream_read_bandwidth()
        result["stream_read_gb_per_s"] = round(bandwidth / 1e9, 2)
        result["decode_step_bytes"] = {str(b): decode_step_bytes(checkpoint, b, DECODE_CONTEXT, model.dtype.itemsize)
                                       for b in DECODE_BATCHES}
        result["roofline_fraction"] = _roofline(checkpoint, ours, bandwidth, model.dtype.itemsize)
        result["model_type"] = cfg.model_type
        sizes = kv_sizes(cfg, model.dtype)
        result["kv"] = {"pool_bytes_per_token": round(sizes.pool_bytes_per_token),
                        "window_bytes_per_sequence": sizes.window_bytes_per_sequence, "unit_bytes": sizes.unit_bytes,
                        "resume_bytes": sizes.resume_bytes, "prefix_4k_load_bytes": sizes.prefix_load_bytes(4096)}
    return result
