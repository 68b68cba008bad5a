"""CPU kernels for decode-sized batches (C++, built on first use), beside torch references.

Legend: M rows, K input features, N output features, R expert-sorted rows, E experts,
I expert intermediate size, H hidden size, A active experts.

BLAS sgemm is tuned for large M; at decode (M <= 16 rows) it reaches a fraction of memory
bandwidth on many CPUs. ``small_linear`` and ``moe_experts`` stream each weight byte once.
``small_linear_q8`` and ``moe_routed_q8`` do the same over int8 weights with a float32 scale per
row and group of G columns (``quantize_q8``; G divides K), reading a quarter of the bytes.
``mla_decode_paged`` is the absorbed MLA decode of ``kernels.mla_decode`` reading the paged pool
in place: no gathered copy of the context, and work in proportion to each row's own length;
``mla_chunk_paged`` does the same for a prefill chunk's queries, reading each latent once for all
of them; both cut a long context over the threads. ``mla_fused`` is a layer's whole absorbed
attention past its projections (RoPE, the latents' norm and write, W_UK, the paged attention of a
prefill chunk's rows and decode rows together, W_UV) in one call.
``rms_norm`` and ``moe_route`` (DeepSeek's top-K gate from its logits) each do in one call what
costs a dozen small torch ops, whose dispatch dominates at decode sizes; ``argmax_rows`` is a
greedy step's choice, vectorized; ``sample_rows`` a sampled one (temperature, top-k, top-p and the
draw, one pass or two over each row; ``model.sampling`` holds its torch reference); ``index_topk``
(``csrc/cpu_index.cpp``) the lightning indexer's top-k keys of decode rows, read in place
(``kernels.index_topk`` holds its contract and reference).
``DecodeStep`` (``csrc/cpu_decode.cpp``, built by ``model.cpu_step``) chains the kernels into a
model's whole decode step.
The extension is compiled with the machine's C++ compiler the first time it is needed (``scripts/setup.sh``
builds it: ``python -m kernels.cpu_gemv``) into a directory of this install keyed by the source, the
flags, torch and the install (``build_dir``), so installs on one machine never rebuild each
other's copy; if that fails, or ``TIDE_CPU_KERNELS=0``, callers use the references.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "Q8_GROUP",
    "argmax_rows",
    "ROUTE_METHODS",
    "build_dir",
    "prune_other_builds",
    "cpu_kernels",
    "dequantize_q8",
    "kernel_state",
    "mla_chunk_paged",
    "mla_fused",
    "mla_decode_paged",
    "moe_experts",
    "moe_route",
    "moe_routed",
    "moe_routed_q8",
    "quantize_q8",
    "ref_argmax_rows",
    "ref_mla_chunk_paged",
    "ref_mla_fused",
    "ref_moe_experts",
    "ref_moe_route",
    "ref_moe_routed",
    "ref_moe_routed_q8",
    "ref_rms_norm",
    "ref_small_linear",
    "ref_small_linear_q8",
    "rms_norm",
    "sample_rows",
    "small_linear",
    "small_linear_q8",
]

Q8_GROUP = 128  # columns per int8 scale (the 128-wide blocks of DeepSeek's FP8 checkpoints)

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}
_CSRC = Path(__file__).with_name("csrc")
# with the headers beside them
_SOURCES = tuple(_CSRC / f for f in ("cpu_gemv.cpp", "cpu_mla.cpp", "cpu_decode.cpp", "cpu_sample.cpp",
                                      "cpu_index.cpp"))
# The sources include only the ATen headers they use (ATen/core/Tensor.h, ATen/ops/<op>.h): a
# whole-ATen or torch/extension.h include costs seconds of every build (tests/kernels checks them)
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
_LDFLAGS = ("-fopenmp",)


def build_dir() -> Path:
    """Where the extension is built: ``$TIDE_KERNEL_BUILD_DIR``, else under this interpreter's
    prefix (the virtual environment), else the user's cache, in a folder named by a hash of
    everything the binary depends on: the sources, the flags, torch and the install
    (``sys.prefix``, one for every name its interpreter is run by: Ray's workers run
    ``bin/python3`` where setup ran ``bin/python``)."""
    key = hashlib.sha256(b"\0".join([
        *(f.read_bytes() for f in sorted(_CSRC.iterdir()) if f.suffix in (".cpp", ".h")), " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
        sys.prefix.encode(), (sysconfig.get_config_var("EXT_SUFFIX") or "").encode(),
    ])).hexdigest()[:16]
    if os.environ.get("TIDE_KERNEL_BUILD_DIR"):
        root = Path(os.environ["TIDE_KERNEL_BUILD_DIR"])
    elif os.access(sys.prefix, os.W_OK):
        root = Path(sys.prefix) / "share" / "tideserve" / "kernels"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tideserve" / "kernels"
    return root / f"cpu_gemv-{key}"


STALE_BUILD_S = 3600  # another build untouched this long is no install's current one


def prune_other_builds(now: float | None = None) -> list[Path]:
    """Remove this virtual environment's other ``cpu_gemv-*`` builds (one is left per source
    change) that nothing wrote to in ``STALE_BUILD_S``: a build under way is kept, and a process
    that loaded an older one keeps its mapped copy. Builds outside ``sys.prefix`` (a shared
    cache, ``$TIDE_KERNEL_BUILD_DIR``) may be other installs' and are left alone. Returns the
    removed directories."""
    import shutil
    import time

    now = time.time() if now is None else now
    keep = build_dir()
    if not keep.is_relative_to(sys.prefix):
        return []
    removed = []
    for other in keep.parent.glob("cpu_gemv-*") if keep.parent.is_dir() else ():
        try:
            if other != keep and other.is_dir() and now - other.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(other)
                removed.append(other)
        except OSError as e:  # not ours to remove, or gone meanwhile
            log.info("old kernel build %s kept: %s", other, e)
    return removed


@contextlib.contextmanager
def _install_scripts_first():
    """PATH with this install's scripts directory (``.venv/bin``) first while the extension
    builds. torch runs whichever ``ninja`` PATH finds: an unactivated venv (``.venv/bin/tide
    up``) finds none on a machine without a system ninja, and two ninja versions throw away each
    other's build log, so each rebuilds everything. The install's own (pyproject.toml pins it) is
    the one every process of it uses."""
    scripts = sysconfig.get_path("scripts")
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([scripts, *(p for p in before.split(os.pathsep) if p and p != scripts)])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def kernel_state() -> str:
    """``loaded`` (built and in this process), ``unavailable`` (the build failed or is off), or
    ``not loaded`` (nothing asked for it yet)."""
    if "mod" not in _state:
        return "not loaded"
    return "loaded" if _state["mod"] is not None else "unavailable"


def cpu_kernels():
    """The compiled extension module, or None when unavailable (reason logged once)."""
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod = None
        if os.environ.get("TIDE_CPU_KERNELS", "1") != "0":
            try:
                from torch.utils.cpp_extension import load

                out = build_dir()
                out.mkdir(parents=True, exist_ok=True)
                with _install_scripts_first():
                    mod = load(
                        name="tide_cpu_gemv",
                        sources=[str(f) for f in _SOURCES],
                        extra_cflags=list(_CFLAGS),
                        extra_ldflags=list(_LDFLAGS),
                        build_directory=str(out),
                        verbose=False,
                    )
            except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, build error
                log.warning("CPU decode kernels unavailable, using torch references: %s", e)
        _state["mod"] = mod
        return mod


def ref_small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N]."""
    return F.linear(x, w)


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as ``ref_small_linear``; fp32 contiguous CPU inputs only."""
    mod = cpu_kernels()
    if mod is None:
        return ref_small_linear(x, w)
    return mod.small_linear(x, w)


def ref_moe_experts(
    xs: torch.Tensor, spans: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """xs [R, H] sorted by expert; spans [A, 3] int64 (expert, lo, hi); gate_up [E, 2I, H];
    down [E, H, I] -> ys [R, H], ys[lo:hi] = down_e(silu(gate_e(x)) * up_e(x)); with ``limit``
    (DeepSeek-V4) gate clipped above at it and up to [-limit, limit] first."""
    ys = torch.zeros_like(xs)
    for expert, lo, hi in spans.tolist():
        g, u = F.linear(xs[lo:hi], gate_up[expert]).chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        ys[lo:hi] = F.linear(F.silu(g) * u, down[expert])
    return ys


def moe_experts(
    xs: torch.Tensor, spans: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``ref_moe_experts``."""
    mod = cpu_kernels()
    if mod is None:
        return ref_moe_experts(xs, spans, gate_up, down)
    return mod.moe_experts(xs, spans, gate_up, down)


def ref_moe_routed(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """x [T, H], ids [T, K] int64, weights [T, K] fp32, gate_up [E, 2I, H], down [E, H, I] ->
    [T, H] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (``limit``: ``ref_moe_experts``')."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    ends = counts.cumsum(0)
    active = counts.nonzero()[:, 0]
    spans = torch.stack((active, ends[active] - counts[active], ends[active]), dim=1)
    ys = ref_moe_experts(x.index_select(0, order // k), spans, gate_up, down, limit)
    ys = ys * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, order // k, ys)


def moe_routed(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``ref_moe_routed``; one call instead of a dozen small ops per layer."""
    mod = cpu_kernels()
    if mod is None:
        return ref_moe_routed(x, ids, weights, gate_up, down, limit)
    if limit is not None:
        return mod.moe_routed_clipped(x, ids, weights, gate_up, down, limit)
    return mod.moe_routed(x, ids, weights, gate_up, down)


def quantize_q8(w: torch.Tensor, group: int = Q8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q int8 [..., N, K], scale float32 [..., N, K / G]): symmetric, one
    scale per row and group of G columns (G = ``group`` when it divides K, else K), so that
    ``q * scale`` is within half a step (scale / 2) of w."""
    k = w.shape[-1]
    g = group if k % group == 0 else k
    blocks = w.float().reshape(*w.shape[:-1], k // g, g)  # [..., N, K/G, G]
    scale = blocks.abs().amax(dim=-1).clamp_min(1e-30) / 127.0  # [..., N, K/G]
    q = torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape).contiguous(), scale.contiguous()


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [..., N, K], scale [..., N, K / G]) -> float32 [..., N, K]."""
    groups = scale.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    return (blocks * scale[..., None]).reshape(q.shape)


def ref_small_linear_q8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, q [N, K] int8, scale [N, K / G] -> [M, N]."""
    return F.linear(x, dequantize_q8(q, scale))


def small_linear_q8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Same contract as ``ref_small_linear_q8``; fp32 contiguous CPU activations only."""
    mod = cpu_kernels()
    if mod is None:
        return ref_small_linear_q8(x, q, scale)
    return mod.small_linear_q8(x, q, scale)


def ref_moe_routed_q8(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_q: torch.Tensor, gate_up_scale: torch.Tensor,
    down_q: torch.Tensor, down_scale: torch.Tensor,
) -> torch.Tensor:
    """``ref_moe_routed`` with int8 experts: gate_up_q [E, 2I, H] (scales [E, 2I, H / G]),
    down_q [E, H, I] (scales [E, H, I / G])."""
    return ref_moe_routed(x, ids, weights, dequantize_q8(gate_up_q, gate_up_scale), dequantize_q8(down_q, down_scale))


def moe_routed_q8(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_q: torch.Tensor, gate_up_scale: torch.Tensor,
    down_q: torch.Tensor, down_scale: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``ref_moe_routed_q8``."""
    mod = cpu_kernels()
    if mod is None:
        return ref_moe_routed_q8(x, ids, weights, gate_up_q, gate_up_scale, down_q, down_scale)
    return mod.moe_routed_q8(x, ids, weights, gate_up_q, gate_up_scale, down_q, down_scale)


def mla_decode_paged(
    q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, page_size: int,
) -> torch.Tensor:
    """The contract of ``kernels.mla_decode.mla_decode`` for fp32 CPU tensors (the reference,
    ``ref_mla_decode``, when the extension is unavailable)."""
    mod = cpu_kernels()
    if mod is None:
        from kernels.mla_decode import ref_mla_decode

        return ref_mla_decode(q_lat, q_rope, kv, block_table, seq_lens, scale, page_size)
    return mod.mla_decode_paged(q_lat.contiguous(), q_rope.contiguous(), kv, block_table.long(), seq_lens.long(),
                                scale, page_size)


def ref_mla_chunk_paged(
    q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, start: int,
    scale: float, page_size: int,
) -> torch.Tensor:
    """A prefill chunk's absorbed attention over its sequence in the paged pool: q_lat [T, H, R]
    and q_rope [T, H, P] of the tokens at positions ``start .. start + T - 1``, whose latents and
    those of every earlier token are in ``kv`` [slots, R + P] at ``block_table`` [X]; query t
    attends tokens ``0 .. start + t`` -> [T, H, R] (``ref_mla_decode`` with a row per query)."""
    from kernels.mla_decode import ref_mla_decode

    t = q_lat.shape[0]
    lens = torch.arange(start + 1, start + t + 1, device=kv.device)
    return ref_mla_decode(q_lat, q_rope, kv, block_table[None].expand(t, -1), lens, scale, page_size)


def mla_chunk_paged(
    q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, start: int,
    scale: float, page_size: int,
) -> torch.Tensor:
    """Same contract as ``ref_mla_chunk_paged`` for fp32 CPU tensors: each latent row is read once
    for every query and head of the chunk."""
    mod = cpu_kernels()
    if mod is None:
        return ref_mla_chunk_paged(q_lat, q_rope, kv, block_table, start, scale, page_size)
    return mod.mla_chunk_paged(q_lat.contiguous(), q_rope.contiguous(), kv, block_table.long(), start, scale,
                               page_size)


def ref_argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> [M] int64: the index of each row's largest value (the first of equal ones; a
    NaN counts as the largest)."""
    return x.argmax(dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``ref_argmax_rows``; fp32 contiguous CPU tensors (torch's CPU argmax is
    not vectorized: a greedy step's choice over a 129K vocabulary costs milliseconds there)."""
    mod = cpu_kernels()
    if mod is None:
        return ref_argmax_rows(x)
    return mod.argmax_rows(x)


def ref_mla_fused(
    q: torch.Tensor, kv_a: torch.Tensor, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    interleave: bool, w_uk: torch.Tensor, w_uv_t: torch.Tensor, kv: torch.Tensor, new_slots: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, page_size: int,
    chunk_table: torch.Tensor | None = None, chunk_start: int = 0,
) -> torch.Tensor:
    """A layer's absorbed MLA attention from its projections, for a pass of a prefill chunk's T
    rows (positions ``chunk_start ..`` of the sequence at ``chunk_table``; none without it) and
    then B decode rows (``block_table`` [B, X], ``seq_lens`` [B]): q [T+B, H*(N+P)] (each head
    [q_nope, q_rope]), kv_a [T+B, R+P] (kv_a_proj_with_mqa's output), cos/sin [T+B, P/2], w_uk
    [H, N, R], w_uv_t [H, R, V], kv [slots, R+P] -> [T+B, H*V]. Writes row i's latent
    [RMSNorm(c_kv) * kv_norm, RoPE(k_rope)] into ``kv`` at ``new_slots[i]``, then attends with
    q_lat = q_nope @ W_UK (``ref_mla_chunk_paged``, ``ref_mla_decode``) and returns o_lat @ W_UV."""
    from kernels.mla_decode import ref_mla_decode

    def apply_rope(x, cos, sin, interleave):  # x [rows, ..., P] -> [rotated firsts, rotated seconds]
        cos, sin = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), -1), sin.view(sin.shape[0], *([1] * (x.dim() - 2)), -1)
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    rows, (h, n, r) = q.shape[0], w_uk.shape
    t = rows - block_table.shape[0]
    p = kv.shape[1] - r
    q = q.view(rows, h, n + p)
    c_kv = F.rms_norm(kv_a[:, :r], (r,), kv_norm, eps)
    kv.index_copy_(0, new_slots, torch.cat((c_kv, apply_rope(kv_a[:, r:], cos, sin, interleave)), dim=-1))
    q_lat = torch.bmm(q[..., :n].transpose(0, 1), w_uk).transpose(0, 1).contiguous()  # [rows, H, R]
    q_rope = apply_rope(q[..., n:], cos, sin, interleave).contiguous()
    parts = [] if t == 0 else [ref_mla_chunk_paged(q_lat[:t], q_rope[:t], kv, chunk_table, chunk_start, scale, page_size)]
    if t < rows:
        parts.append(ref_mla_decode(q_lat[t:], q_rope[t:], kv, block_table, seq_lens, scale, page_size))
    o_lat = torch.cat(parts)
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(rows, -1)


def mla_fused(
    q: torch.Tensor, kv_a: torch.Tensor, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    interleave: bool, w_uk: torch.Tensor, w_uv_t: torch.Tensor, kv: torch.Tensor, new_slots: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, page_size: int,
    chunk_table: torch.Tensor | None = None, chunk_start: int = 0,
) -> torch.Tensor:
    """Same contract as ``ref_mla_fused`` for fp32 CPU tensors: one call for what is a dozen
    small ops per layer in torch, the chunk's and the batch's attention in one parallel pass."""
    mod = cpu_kernels()
    if mod is None:
        return ref_mla_fused(q, kv_a, kv_norm, eps, cos, sin, interleave, w_uk, w_uv_t, kv, new_slots, block_table,
                             seq_lens, scale, page_size, chunk_table, chunk_start)
    return mod.mla_fused(q.contiguous(), kv_a.contiguous(), kv_norm.contiguous(), eps, cos.contiguous(),
                         sin.contiguous(), interleave, w_uk, w_uv_t, kv, new_slots.long(), block_table.long(),
                         seq_lens.long(), None if chunk_table is None else chunk_table.long(), chunk_start, scale,
                         page_size)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H], w [H] -> x * rsqrt(mean(x^2) + eps) * w, row by row."""
    return F.rms_norm(x, w.shape, w, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``ref_rms_norm``; fp32 contiguous CPU tensors only."""
    mod = cpu_kernels()
    if mod is None:
        return ref_rms_norm(x, w, eps)
    return mod.rms_norm(x, w, eps)


ROUTE_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def ref_moe_route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_groups: int, topk_group: int, method: str,
    softmax: bool, norm: bool, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek top-K routing from gate logits [T, E] -> (ids [T, K] int64, a token's best
    first; weights [T, K] fp32).

    Scores are ``softmax`` (V2) or sigmoid (V3) of the logits. ``greedy``: the K best scores.
    ``group_limited_greedy``: only the ``topk_group`` groups with the best single score compete.
    ``noaux_tc``: the bias steers the *choice* only (choice = scores + bias; groups ranked by the
    sum of their best two choices); the weights are the unbiased scores. Weights are normalised to
    sum 1 when ``norm`` (and K > 1), then multiplied by ``scaling``.
    """
    t, e = logits.shape
    g = num_groups
    scores = logits.float().softmax(dim=-1) if softmax else logits.float().sigmoid()
    choice = scores
    if method == "noaux_tc" and bias is not None:
        choice = scores + bias.float()
    if method in ("group_limited_greedy", "noaux_tc") and g > 1:
        grouped = choice.view(t, g, e // g)
        if method == "noaux_tc":
            group_scores = grouped.topk(min(2, e // g), dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask[:, :, None].expand(t, g, e // g).reshape(t, e)
        choice = choice.masked_fill(~keep, float("-inf") if method == "noaux_tc" else 0.0)
    ids = choice.topk(top_k, dim=-1).indices  # [T, K], best first
    weights = scores.gather(1, ids)  # [T, K]
    if norm and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def moe_route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_groups: int, topk_group: int, method: str,
    softmax: bool, norm: bool, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``ref_moe_route``; fp32 contiguous CPU logits. One call for what costs a
    dozen small ops in torch: meant for decode-sized T."""
    if method not in ROUTE_METHODS:
        raise ValueError(f"unknown routing method {method!r}; known: {ROUTE_METHODS}")
    mod = cpu_kernels()
    if mod is None:
        return ref_moe_route(logits, bias, top_k, num_groups, topk_group, method, softmax, norm, scaling)
    bias = bias.float().contiguous() if bias is not None and method == "noaux_tc" else None
    return mod.moe_route(logits, bias, top_k, num_groups, topk_group, ROUTE_METHODS.index(method), softmax, norm,
                         scaling)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                u: torch.Tensor) -> torch.Tensor | None:
    """logits [R, V] fp32 CPU, temperature [R] (> 0), top_k [R] int64 (0: off), top_p [R] (1: off),
    u [R] float64 in (0, 1] -> a token per row [R] int64 (``model.sampling``'s contract); None
    when the kernels are unavailable (the caller takes its torch path)."""
    mod = cpu_kernels()
    if mod is None:
        return None
    return mod.sample_rows(logits.contiguous(), temperature.float().contiguous(), top_k.long().contiguous(),
                           top_p.float().contiguous(), u.double().contiguous())


if __name__ == "__main__":  # scripts/setup.sh: build the extension once, at install time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if cpu_kernels() is None:
        print("CPU decode kernels could not be built; the torch references will be used", file=sys.stderr)
        sys.exit(1)
    print(f"CPU decode kernels built in {build_dir()}")
    for old in prune_other_builds():
        print(f"removed an older build, {old}")
