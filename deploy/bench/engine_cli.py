"""``tide bench`` on one process: the model, the engine, expert placement and parallelism, structured
output, kernels, unit I/O."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

from deploy.bench.cli_common import PLOT, check_plot, emit, family_name, ints, plotted
from deploy.options import check_checkpoint, check_device, check_dtype


def bench_model(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the bench config, random weights"),
    steps: int = typer.Option(16, "--steps", min=1, help="decode steps per measurement"),
    repeats: int = typer.Option(5, "--repeats", min=1, help="timed repeats, tideserve and transformers taking turns (the median counts; range beside it)"),
    no_hf: bool = typer.Option(False, "--no-hf", help="skip the transformers comparison"),
    no_int8: bool = typer.Option(False, "--no-int8", help="skip the int8-weights cases"),
    family: str = typer.Option("v3", "--family", help="without --checkpoint: the bench config of v3, v3.2 or v4"),
    mtp: bool = typer.Option(True, "--mtp/--no-mtp", help="with a checkpoint that has MTP layers: decode tokens/s through the engine with and without their drafts (batch 1/2/4/8/32) and the acceptance"),
    mtp_only: bool = typer.Option(False, "--mtp-only", help="only the MTP section"),
    mtp_tokens: int = typer.Option(64, "--mtp-tokens", min=8, help="tokens each request decodes in the MTP section"),
    mtp_batches: str = typer.Option("1,2,4,8,32", "--mtp-batches", help="the MTP section's batch sizes, comma-separated"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda: where the MTP section runs (--mtp-only; the other sections are the CPU's)"),
    dtype: str = typer.Option(None, "--dtype", help="the MTP section's dtype (default: float32 on the CPU, bfloat16 on CUDA)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Prefill (2,048-token prompt) and decode (batch 1/8/32, 256-token context) tokens/s,
    decode both of model.decode alone and through the engine's step, beside transformers on
    the same checkpoint and threads when it is installed; medians with their range. ``int8``:
    the same with the weights held in int8 (--cpu-weights int8), its speedups over fp32 and the
    bytes of the weights (MLA families). ``kv``: the KV's bytes per token in a replica, per cache
    unit, and what a 4K prefix hit loads. ``mtp`` (a checkpoint with MTP layers, e.g. the
    default model's, model/weights/tiny): engine decode tokens/s with and without speculative
    decoding, their speedup and the drafts' acceptance per position."""
    from deploy.bench.model_bench import run_model_bench
    from deploy.bench.mtp_bench import mtp_decode_bench

    check_checkpoint(checkpoint)
    check_device(device)
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    check_dtype(dtype)
    batches = ints(mtp_batches, "--mtp-batches")
    if device == "cuda":
        import torch

        if not mtp_only:
            raise typer.BadParameter("--device cuda measures the MTP section alone: add --mtp-only")
        if not torch.cuda.is_available():
            raise typer.BadParameter("--device cuda: torch sees no CUDA device here")
    if mtp_only:
        from model.default import default_checkpoint

        ckpt = checkpoint or default_checkpoint()
        emit({"checkpoint": str(ckpt), "mtp": mtp_decode_bench(ckpt, tokens=mtp_tokens, repeats=repeats,
                                                                batches=batches, device=device, dtype=dtype)})
        return
    result = run_model_bench(checkpoint, steps=steps, repeats=repeats, with_hf=not no_hf, with_int8=not no_int8,
                             family=family_name(family))
    if mtp and checkpoint is not None:
        result["mtp"] = mtp_decode_bench(checkpoint, tokens=mtp_tokens, repeats=repeats, batches=batches, dtype=dtype)
    emit(result)


def bench_engine(
    batches: str = typer.Option("1,16,64,256", "--batches", help="running sequences, comma-separated"),
    contexts: str = typer.Option("1024,8192,32768", "--contexts", help="tokens each sequence holds, comma-separated"),
    steps: int = typer.Option(30, "--steps", min=5, help="timed decode steps per round of a case (3 rounds, after 5 untimed steps; the lowest round median counts)"),
    itl: bool = typer.Option(True, "--itl/--no-itl", help="also the inter-token latency of 16 decoding requests while a long prompt is prefilled, with sized and fixed chunks (bench config, a few minutes), and of one request beside a 2K prompt on the tiny config, with and without the itl floor"),
    itl_prompt_tokens: int = typer.Option(8000, "--itl-prompt-tokens", min=64, max=8000),
    plot: Path = PLOT,
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """The engine's host work per decode step (host_ms_per_step: median and p90) with a model
    that costs nothing, by batch and context, and how it grows with context; the sampler alone
    at DeepSeek-V3's vocabulary (sampling_ms: temperature, top-k, top-p, batches up to 64); the
    inter-token latency of running requests while a long prompt is prefilled (itl)."""
    from deploy.bench.engine_bench import run_engine_bench, run_itl_bench

    check_plot(plot)
    out = run_engine_bench(ints(batches, "--batches"), ints(contexts, "--contexts"), steps)
    if itl:
        out["itl"] = run_itl_bench(prompt_tokens=itl_prompt_tokens)
    emit(plotted("engine", out, plot))


def bench_eplb(
    layers: int = typer.Option(58, "--layers", min=1, help="MoE layers"),
    experts: int = typer.Option(256, "--experts", min=1),
    groups: int = typer.Option(8, "--groups", min=1),
    shards: int = typer.Option(32, "--shards", min=1),
    nodes: int = typer.Option(4, "--nodes", min=1),
    slots: int = typer.Option(288, "--slots", min=1),
    exponents: str = typer.Option("0.5,1.0,1.5", "--exponents", help="Zipf exponents, comma-separated"),
    window_drift: float = typer.Option(0.2, "--window-drift", min=0.0, help="log-std of each expert's load change from one window to the next (out-of-sample scores)"),
    rows_per_shard: int = typer.Option(32, "--rows-per-shard", min=1, help="(token, expert) pairs per shard of the sampled batches (tokens of 8 experts each)"),
    plot: Path = PLOT,
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """EPLB policies (global, hierarchical, spill) on Zipf-skewed loads: imbalance before/after
    (in sample), on the next window of a drifting load and on batches sampled from it (out of
    sample, beside the sampling floor), spill_fraction, runtime_ms, and moved_slots when
    re-planning after a 5% load drift."""
    from cluster.eplb import EplbConfig
    from deploy.bench.eplb_bench import run_eplb_bench

    try:
        exps = tuple(float(x) for x in exponents.split(","))
    except ValueError:
        raise typer.BadParameter(f"--exponents {exponents!r} must be comma-separated numbers") from None
    try:
        EplbConfig(slots, groups, nodes, shards)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if experts % shards or experts % groups or slots < experts:
        raise typer.BadParameter(
            f"--experts {experts} must divide by --shards {shards} and --groups {groups} and be <= --slots {slots}"
        )
    check_plot(plot)
    emit(plotted("eplb", run_eplb_bench(exps, experts, groups, shards, nodes, slots, layers,
                                          window_drift=window_drift, rows_per_shard=rows_per_shard), plot))


def bench_ep(
    nodes: int = typer.Option(3, "--nodes", min=1, max=8, help="simulated nodes, one expert shard each"),
    batch: int = typer.Option(32, "--batch", min=2),
    context: int = typer.Option(256, "--context", min=1, help="tokens of KV per sequence"),
    steps: int = typer.Option(8, "--steps", min=1, help="timed decode steps (median reported)"),
    config: str = typer.Option("bench", "--config", help="named model config (random weights)"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="runs of every case, taking turns (medians reported, with ranges)"),
    wire_only: bool = typer.Option(False, "--wire-only", help="only the bytes on the wire per round and step (bf16 vs fp8 dispatch), without a cluster"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Decode tokens/s and step latency with experts on shards across simulated Ray nodes,
    two micro-batches on and off, beside one process in the same cluster, taking turns;
    overlap_speedup and dispatch_hidden_fraction (counted only where the overlap is faster); the bytes
    per round and per decode step with BF16 rows and with FP8 dispatch + BF16 combine."""
    from deploy.bench.ep_bench import run_ep_bench, run_wire_bench
    from model.config import NAMED_CONFIGS

    if config not in NAMED_CONFIGS:
        raise typer.BadParameter(f"--config {config!r} is not one of {sorted(NAMED_CONFIGS)}")
    with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
        result = run_wire_bench(nodes, batch, config) if wire_only else run_ep_bench(nodes, batch, context, steps,
                                                                                      config, repeats)
    emit(result)


def bench_structured(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="take the vocabulary from this checkpoint's tokenizer"),
    vocab: int = typer.Option(129_280, "--vocab", min=256, help="synthetic vocabulary size (without --checkpoint)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Structured output's token masks on xgrammar: the vocabulary's tokenizer info, compile times
    (JSON mode, a typical schema, a 1,000-property schema, a choice of 1,024 texts), the mask per
    step over a typical object, and applying a batch of 32 masks to the logits."""
    from deploy.bench.structured_bench import run_structured_bench

    check_checkpoint(checkpoint)
    emit(run_structured_bench(checkpoint, vocab))


def bench_kernels(
    peak_gbps: float = typer.Option(None, "--peak-gbps", min=1.0, help="device peak memory GB/s (default: from NVML)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Triton kernels on CUDA: MLA decode GB/s and fraction of peak bandwidth (batch 64/128,
    context 4K/32K, bf16, DeepSeek-V3 dims), MoE grouped GEMM TFLOP/s, FP8 GEMMs, and the engine's
    decode step eager vs replayed as a CUDA graph. Without CUDA it says so and exits 0."""
    from deploy.bench.kernel_bench import run_kernel_bench

    emit(run_kernel_bench(peak_gbps))


def bench_unit_io(
    dir: Path = typer.Option(None, "--dir", help="directory on the disk to measure (default: the temp dir)"),
    total_mb: int = typer.Option(256, "--total-mb", min=8, help="bytes written and read per measurement"),
    layout: list[str] = typer.Option(None, "--layout", help="store layout(s) to measure: unit, segment (default: both)"),
    run_units: int = typer.Option(128, "--run-units", min=1, help="units a request persists and loads together"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="timed repeats (medians count, raw and units alike)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Unit write/read GB/s (bench-model and DeepSeek-V3-sized units) for each store layout
    (a file per unit, segment files) as a fraction of the same disk's raw speed from fio (Debian
    package fio: O_DIRECT, the block the layout reads, queue depth = the store's 4 I/O threads).
    Units are written in runs (a request's units, all runs queued at once) and read back cold
    (page cache dropped) run after run, after a warm-up pass over other units (the staging
    buffers in use, as in a running server; no read-ahead warmed on the timed files). Medians of
    --repeats with the read range. ``integrity``: the host cost per unit of the keyed unit hash
    and the unit MAC (beside the unkeyed hash and the checksum)."""
    from cachedir.layout import LAYOUTS
    from deploy.bench.cache_bench import run_unit_io

    if dir is not None and not dir.is_dir():
        raise typer.BadParameter(f"--dir {str(dir)!r} is not a directory")
    for name in layout or ():
        if name not in LAYOUTS:
            raise typer.BadParameter(f"--layout {name!r} is not one of: {', '.join(LAYOUTS)}")
    emit(run_unit_io(dir, total_mb, tuple(layout) if layout else LAYOUTS, run_units, repeats))
