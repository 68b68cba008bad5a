"""CPU decode kernels against their torch references over odd shapes."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernels.cpu_gemv import (
    cpu_kernels,
    moe_experts,
    ref_moe_experts,
    ref_small_linear,
    small_linear,
)
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _kernels_built():
    require(cpu_kernels() is not None, "the CPU kernel extension did not build (see the log)")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("k, n", [(8, 1), (60, 63), (512, 257), (1536, 64)])
def test_small_linear_matches_reference(m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    torch.testing.assert_close(small_linear(x, w), ref_small_linear(x, w), atol=1e-4, rtol=1e-5)


def _spans(counts):
    spans, begin = [], 0
    for expert, n in enumerate(counts):
        if n:
            spans.append((expert, begin, begin + n))
            begin += n
    return torch.tensor(spans, dtype=torch.long).view(-1, 3), begin


@pytest.mark.parametrize("counts", [[1], [0, 3, 0, 1, 7], [2] * 9, [0, 0, 0, 5]])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (60, 20), (512, 256)])
def test_moe_experts_matches_reference(counts, hidden, inter):
    gen = torch.Generator().manual_seed(len(counts) + hidden)
    e = max(len(counts), 4)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(e, hidden, inter, generator=gen) * 0.1
    spans, rows = _spans(counts)
    xs = torch.randn(rows, hidden, generator=gen)
    torch.testing.assert_close(
        moe_experts(xs, spans, gate_up, down), ref_moe_experts(xs, spans, gate_up, down), atol=1e-4, rtol=1e-5
    )


def test_bad_inputs_are_rejected_with_the_reason():
    mod = cpu_kernels()
    with pytest.raises(RuntimeError, match="float32"):
        mod.small_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        mod.small_linear(torch.ones(2, 8), torch.ones(3, 9))
    with pytest.raises(RuntimeError, match="expert id 7"):
        mod.moe_experts(torch.ones(2, 8), torch.tensor([[7, 0, 2]]), torch.ones(4, 8, 8), torch.ones(4, 8, 4))


@pytest.mark.parametrize("t, k, e", [(1, 1, 4), (8, 4, 32), (5, 2, 3), (33, 6, 16)])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (60, 20)])
def test_moe_routed_matches_reference(t, k, e, hidden, inter):
    from kernels.cpu_gemv import moe_routed, ref_moe_routed

    gen = torch.Generator().manual_seed(t * 100 + k + e)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(e, hidden, inter, generator=gen) * 0.1
    x = torch.randn(t, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[: min(k, e)] for _ in range(t)])
    weights = torch.rand(ids.shape, generator=gen)
    torch.testing.assert_close(moe_routed(x, ids, weights, gate_up, down),
                               ref_moe_routed(x, ids, weights, gate_up, down), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="expert id"):
        cpu_kernels().moe_routed(x, ids + e, weights, gate_up, down)
    # DeepSeek-V4's clipped SwiGLU: a limit that clips many gate and up values changes the output
    loud = gate_up * 40
    clipped = ref_moe_routed(x, ids, weights, loud, down, limit=0.5)
    torch.testing.assert_close(moe_routed(x, ids, weights, loud, down, limit=0.5), clipped, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(clipped, ref_moe_routed(x, ids, weights, loud, down), atol=1e-3)


@pytest.mark.parametrize("k, group", [(256, 128), (60, 128), (512, 64)])
def test_q8_quantization_is_within_half_a_step_and_round_trips(k, group):
    from kernels.cpu_gemv import dequantize_q8, quantize_q8

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(3, 37, k, generator=gen) * torch.logspace(-3, 1, k)  # columns of very different sizes
    q, scale = quantize_q8(w, group)
    g = group if k % group == 0 else k  # a group that does not divide K: one scale per row
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (3, 37, k // g)
    err = (dequantize_q8(q, scale) - w).abs().reshape(3, 37, k // g, g)
    assert bool((err <= scale[..., None] / 2 + 1e-7).all())
    assert torch.equal(quantize_q8(dequantize_q8(q, scale), group)[0], q)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 16])
@pytest.mark.parametrize("k, n, group", [(8, 1, 128), (64, 63, 16), (256, 257, 128), (1536, 64, 128), (200, 5, 128)])
def test_small_linear_q8_matches_reference(m, k, n, group):
    from kernels.cpu_gemv import quantize_q8, ref_small_linear_q8, small_linear_q8

    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    q, scale = quantize_q8(w, group)
    torch.testing.assert_close(small_linear_q8(x, q, scale), ref_small_linear_q8(x, q, scale), atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("t, k, e", [(1, 1, 4), (8, 4, 32), (5, 2, 3)])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (256, 128), (60, 20)])
def test_moe_routed_q8_matches_reference(t, k, e, hidden, inter):
    from kernels.cpu_gemv import moe_routed_q8, quantize_q8, ref_moe_routed_q8

    gen = torch.Generator().manual_seed(t * 100 + k + e + hidden)
    gate_up = quantize_q8(torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1)
    down = quantize_q8(torch.randn(e, hidden, inter, generator=gen) * 0.1)
    x = torch.randn(t, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[: min(k, e)] for _ in range(t)])
    weights = torch.rand(ids.shape, generator=gen)
    torch.testing.assert_close(moe_routed_q8(x, ids, weights, *gate_up, *down),
                               ref_moe_routed_q8(x, ids, weights, *gate_up, *down), atol=2e-4, rtol=1e-5)


def test_q8_bad_inputs_are_rejected_with_the_reason():
    mod = cpu_kernels()
    q, scale = torch.zeros(3, 64, dtype=torch.int8), torch.ones(3, 1)
    with pytest.raises(RuntimeError, match="int8"):
        mod.small_linear_q8(torch.ones(2, 64), q.float(), scale)
    with pytest.raises(RuntimeError, match="scale groups do not divide"):
        mod.small_linear_q8(torch.ones(2, 64), q, torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        mod.small_linear_q8(torch.ones(2, 32), q, scale)


def test_the_build_directory_is_one_per_install_and_source(monkeypatch, tmp_path):
    """Two installs (virtual environments) on one machine build into different folders, so
    neither rebuilds the other's copy; the same install finds its own again, whichever name its
    interpreter is run by (setup runs ``bin/python``, a Ray worker started by ``bin/ray``
    ``bin/python3``: one build, not a second one at the first ``tide up``)."""
    from kernels import cpu_gemv

    monkeypatch.delenv("TIDE_KERNEL_BUILD_DIR", raising=False)
    mine = cpu_gemv.build_dir()
    assert mine == cpu_gemv.build_dir() and (mine / "tide_cpu_gemv.so").is_file()  # built by setup or above
    names = [p for p in (Path(sys.prefix) / "bin" / n for n in ("python", "python3", Path(sys.executable).name))
             if p.exists()]
    assert len({p.name for p in names}) >= 2 or sys.prefix == sys.base_prefix  # a venv has both
    for python in names:
        found = subprocess.run([str(python), "-c", "from kernels.cpu_gemv import build_dir; print(build_dir())"],
                               capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert found.stdout.strip() == str(mine), python
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert cpu_gemv.build_dir().name != mine.name
    monkeypatch.setenv("TIDE_KERNEL_BUILD_DIR", str(tmp_path))
    assert cpu_gemv.build_dir().parent == tmp_path


def test_the_build_uses_the_installs_own_ninja_whatever_path_says(tmp_path):
    """An unactivated venv (``.venv/bin/tide up``) on a machine without a system ninja still loads
    the kernels, and runs the same ninja as an activated one: another version would throw the
    build log away and rebuild everything."""
    from kernels.cpu_gemv import build_dir

    bare = tmp_path / "bin"  # the compiler, no ninja
    bare.mkdir()
    for tool in ("c++", "cc", "g++", "gcc"):
        if found := shutil.which(tool):
            (bare / tool).symlink_to(found)
    built = build_dir() / "tide_cpu_gemv.so"
    before = built.stat().st_mtime_ns
    r = subprocess.run([sys.executable, "-m", "kernels.cpu_gemv"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PATH": str(bare)})
    assert r.returncode == 0 and "CPU decode kernels built in" in r.stdout + r.stderr, r.stderr[-2000:]
    assert built.stat().st_mtime_ns == before  # nothing rebuilt


def test_the_build_command_fails_when_the_kernels_cannot_be_built():
    """``python -m kernels.cpu_gemv`` (setup.sh's build) exits 1 and says what is used instead, so
    setup can try again; here the kernels are turned off, as a failed build leaves them."""
    r = subprocess.run([sys.executable, "-m", "kernels.cpu_gemv"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TIDE_CPU_KERNELS": "0"})
    assert r.returncode == 1 and "the torch references will be used" in r.stderr, r.stderr


def test_setup_removes_the_venvs_older_builds_but_not_one_under_way(monkeypatch, tmp_path):
    from kernels import cpu_gemv

    monkeypatch.setenv("TIDE_KERNEL_BUILD_DIR", str(tmp_path / "shared"))
    (tmp_path / "shared" / "cpu_gemv-0ther").mkdir(parents=True)
    assert cpu_gemv.prune_other_builds(time.time() + 10**6) == []  # a folder other installs may share
    monkeypatch.delenv("TIDE_KERNEL_BUILD_DIR")
    (tmp_path / "venv").mkdir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    now = time.time()
    mine = cpu_gemv.build_dir()
    assert mine.parent == tmp_path / "venv" / "share" / "tideserve" / "kernels"
    old, recent, other = (mine.parent / "cpu_gemv-0ld", mine.parent / "cpu_gemv-n3w", mine.parent / "not-a-build")
    for d in (mine, old, recent, other):
        d.mkdir(parents=True)
        (d / "tide_cpu_gemv.so").write_bytes(b"")
    for d in (mine, old, other):
        os.utime(d, (now - 2 * cpu_gemv.STALE_BUILD_S,) * 2)
    assert cpu_gemv.prune_other_builds(now) == [old]
    assert sorted(p.name for p in mine.parent.iterdir()) == sorted([mine.name, recent.name, other.name])
    assert cpu_gemv.prune_other_builds(now + 2 * cpu_gemv.STALE_BUILD_S) == [recent]  # left alone an hour
    assert (mine / "tide_cpu_gemv.so").exists()


@contextlib.contextmanager
def _threads(n):
    """torch (and the kernels) on ``n`` threads meanwhile (a test process may have fewer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _paged_pool(lens, rank, rope, page, gen):
    """Block tables [B, X] of scattered pages and a pool that holds each row's ``lens[b]``
    latents there and NaN in every slot no row attends."""
    b, width = len(lens), -(-max(lens) // page) + 2
    pages = torch.randperm(b * width, generator=gen).view(b, width)
    kv = torch.full((b * width * page, rank + rope), float("nan"))
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        kv[pages[i, pos // page] * page + pos % page] = torch.randn(n, rank + rope, generator=gen)
    return pages, kv


@pytest.mark.parametrize("heads, rank, rope, page", [(8, 128, 32, 16), (20, 60, 12, 4), (1, 16, 8, 1)])
@pytest.mark.parametrize("lens", [[1], [16, 17, 3], [100, 1, 64, 33, 48]])
def test_mla_decode_paged_matches_reference_and_reads_only_each_rows_tokens(heads, rank, rope, page, lens):
    from kernels.cpu_gemv import mla_decode_paged
    from kernels.mla_decode import ref_mla_decode

    gen = torch.Generator().manual_seed(len(lens) * heads)
    b = len(lens)
    pages, kv = _paged_pool(lens, rank, rope, page, gen)  # scattered pages; what no row attends is NaN
    q_lat, q_rope = torch.randn(b, heads, rank, generator=gen), torch.randn(b, heads, rope, generator=gen)
    seq_lens = torch.tensor(lens)
    got = mla_decode_paged(q_lat, q_rope, kv, pages, seq_lens, 0.125, page)
    want = ref_mla_decode(q_lat, q_rope, kv, pages, seq_lens, 0.125, page)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[3000], [2500, 1, 700, 64]])
def test_mla_decode_paged_cuts_long_rows_over_the_threads_and_merges_them(lens, threads):
    """Rows longer than a task's span are attended in several spans (by both threads) and
    merged by their log-sum-exp; one thread takes each row whole. Both equal the reference."""
    from kernels.cpu_gemv import mla_decode_paged
    from kernels.mla_decode import ref_mla_decode

    gen = torch.Generator().manual_seed(len(lens))
    pages, kv = _paged_pool(lens, 64, 16, 16, gen)
    q_lat, q_rope = torch.randn(len(lens), 6, 64, generator=gen), torch.randn(len(lens), 6, 16, generator=gen)
    with _threads(threads):
        got = mla_decode_paged(q_lat, q_rope, kv, pages, torch.tensor(lens), 0.3, 16)
    torch.testing.assert_close(got, ref_mla_decode(q_lat, q_rope, kv, pages, torch.tensor(lens), 0.3, 16),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, rank, rope, page", [(8, 128, 32, 16), (5, 60, 12, 4), (1, 16, 7, 1)])
@pytest.mark.parametrize("start, t", [(0, 1), (0, 33), (130, 1), (63, 17), (2900, 40)])
def test_mla_chunk_paged_matches_reference_and_reads_only_the_prefix(heads, rank, rope, page, start, t):
    """A chunk's queries attend causally (query i over tokens 0 .. start + i) over scattered
    pages, with NaN in every slot past the chunk: odd head counts, ranks and rope dims (the
    vector and scalar paths), one query and many, contexts cut in spans and not."""
    from kernels.cpu_gemv import mla_chunk_paged, ref_mla_chunk_paged

    gen = torch.Generator().manual_seed(start + t + heads)
    pages, kv = _paged_pool([start + t], rank, rope, page, gen)
    q_lat, q_rope = torch.randn(t, heads, rank, generator=gen), torch.randn(t, heads, rope, generator=gen)
    with _threads(2):  # a long context is cut in spans, one per thread at least
        got = mla_chunk_paged(q_lat, q_rope, kv, pages[0], start, 0.125, page)
    want = ref_mla_chunk_paged(q_lat, q_rope, kv, pages[0], start, 0.125, page)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_chunk_paged_rejects_a_chunk_past_its_table_or_pool():
    mod = cpu_kernels()
    q_lat, q_rope, kv = torch.ones(3, 2, 8), torch.ones(3, 2, 4), torch.ones(4 * 16, 12)
    with pytest.raises(RuntimeError, match="a chunk of 3 tokens from 30 does not fit a block table of 2 pages"):
        mod.mla_chunk_paged(q_lat, q_rope, kv, torch.tensor([0, 1]), 30, 1.0, 16)
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] = 7 outside the pool's 4 pages"):
        mod.mla_chunk_paged(q_lat, q_rope, kv, torch.tensor([0, 7]), 20, 1.0, 16)
    with pytest.raises(RuntimeError, match="block_table must be int64 \\[X\\]"):
        mod.mla_chunk_paged(q_lat, q_rope, kv, torch.tensor([[0, 1]]), 0, 1.0, 16)


def test_mla_decode_paged_rejects_a_length_or_page_outside_the_pool():
    mod = cpu_kernels()
    q_lat, q_rope, kv = torch.ones(1, 2, 8), torch.ones(1, 2, 4), torch.ones(4 * 16, 12)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 33 outside \[1, 32\]"):
        mod.mla_decode_paged(q_lat, q_rope, kv, torch.tensor([[0, 1]]), torch.tensor([33]), 1.0, 16)
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] = 9 outside the pool's 4 pages"):
        mod.mla_decode_paged(q_lat, q_rope, kv, torch.tensor([[0, 9]]), torch.tensor([20]), 1.0, 16)
    with pytest.raises(RuntimeError, match="R \\+ P = 13"):
        mod.mla_decode_paged(q_lat, torch.ones(1, 2, 5), kv, torch.tensor([[0, 1]]), torch.tensor([2]), 1.0, 16)


@pytest.mark.parametrize("m, h", [(1, 512), (8, 60), (16, 7168), (3, 1)])
def test_rms_norm_matches_reference(m, h):
    from kernels.cpu_gemv import ref_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(m + h)
    x, w = torch.randn(m, h, generator=gen) * 3, torch.randn(h, generator=gen)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    zeros = torch.zeros(m, h)  # eps keeps an all-zero row finite
    assert torch.equal(rms_norm(zeros, w, 1e-6), zeros)


# (E, K, G, KG): V2-Lite greedy, V2 group-limited, V3 noaux_tc; a group of one expert
ROUTES = [(64, 6, 1, 1, "greedy", True), (160, 6, 8, 3, "group_limited_greedy", True),
          (256, 8, 8, 4, "noaux_tc", False), (32, 4, 4, 2, "noaux_tc", False), (8, 2, 8, 3, "noaux_tc", False),
          (16, 3, 4, 2, "group_limited_greedy", False), (12, 1, 3, 1, "greedy", False)]


@pytest.mark.parametrize("e, k, g, kg, method, softmax", ROUTES)
@pytest.mark.parametrize("t", [1, 5, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_route_matches_reference(e, k, g, kg, method, softmax, t, norm):
    from kernels.cpu_gemv import moe_route, ref_moe_route

    gen = torch.Generator().manual_seed(e * 100 + t)
    logits, bias = torch.randn(t, e, generator=gen) * 2, torch.randn(e, generator=gen) * 0.5
    for b in (bias, None):
        ids, weights = moe_route(logits, b, k, g, kg, method, softmax, norm, 2.5)
        ref_ids, ref_weights = ref_moe_route(logits, b, k, g, kg, method, softmax, norm, 2.5)
        order = ref_ids.sort(dim=-1)  # the reference's order is unspecified; the kernel's is best first
        assert torch.equal(ids.sort(dim=-1).values, order.values)
        torch.testing.assert_close(weights.gather(1, ids.sort(dim=-1).indices), ref_weights.gather(1, order.indices),
                                   atol=1e-6, rtol=1e-5)
        if b is None or method != "noaux_tc":  # best first: without a bias the weights follow the choice
            assert bool((weights[:, :-1] >= weights[:, 1:]).all())


def test_moe_route_rejects_what_the_gate_cannot_do():
    from kernels.cpu_gemv import moe_route

    logits = torch.randn(2, 16)
    with pytest.raises(ValueError, match="unknown routing method"):
        moe_route(logits, None, 2, 4, 2, "top2", False, True, 1.0)
    with pytest.raises(RuntimeError, match="groups"):
        moe_route(logits, None, 12, 4, 2, "noaux_tc", False, True, 1.0)  # 2 groups of 4 hold 8 experts
    with pytest.raises(RuntimeError, match="K = 20"):
        moe_route(logits, None, 20, 1, 1, "greedy", True, True, 1.0)


@pytest.mark.parametrize("m, v", [(1, 1), (3, 7), (64, 512), (5, 129_280), (2, 33)])
def test_argmax_rows_matches_torch_on_ties_nan_and_masked_rows(m, v):
    """The first of equal largest values, a NaN counting as the largest, a row masked to -inf
    everywhere giving 0: as torch.argmax."""
    from kernels.cpu_gemv import argmax_rows, ref_argmax_rows

    gen = torch.Generator().manual_seed(m * v)
    x = torch.randn(m, v, generator=gen)
    rows = [x[i] for i in range(m)]
    rows[0][v // 2 :] = 1e9  # ties: the first of them
    if m > 1:
        rows[1][:] = float("-inf")
    if m > 2:
        rows[2][v - 1] = float("nan")
        rows[2][0] = float("inf")
    assert torch.equal(argmax_rows(x), ref_argmax_rows(x))
    with pytest.raises(RuntimeError, match="V >= 1"):
        cpu_kernels().argmax_rows(torch.ones(2, 0))


@pytest.mark.parametrize("heads, nope, rank, rope, v, page, interleave",
                         [(8, 64, 128, 32, 64, 16, False), (5, 12, 60, 12, 20, 4, True), (1, 8, 16, 8, 8, 1, True)])
@pytest.mark.parametrize("chunk, decode", [(None, 4), ((0, 9), 0), ((30, 7), 4), ((5, 1), 2)])
def test_mla_fused_matches_reference_and_writes_the_new_latents(heads, nope, rank, rope, v, page, interleave, chunk,
                                                                 decode):
    """From a layer's projections, for a prefill chunk's rows ((start, tokens), or none) and
    decode rows: every row's latent normed, rotated and written at its new slot (only there; a
    chunk's queries see its own), and the heads' values as the op-by-op reference gives them."""
    from kernels.cpu_gemv import mla_fused, ref_mla_fused

    gen = torch.Generator().manual_seed(heads * rank + decode)
    lens = [1, 40, 17, 3][:decode] + ([sum(chunk)] if chunk else [])  # the chunk's sequence last in the pool
    pages, kv = _paged_pool(lens, rank, rope, page, gen)
    tables, lens_t = pages[:decode], torch.tensor(lens[:decode], dtype=torch.long)
    new_slots = tables[torch.arange(decode), (lens_t - 1) // page] * page + (lens_t - 1) % page
    chunk_table, start, t = (None, 0, 0) if chunk is None else (pages[decode], *chunk)
    if chunk:
        pos = torch.arange(start, start + t)
        new_slots = torch.cat((chunk_table[pos // page] * page + pos % page, new_slots))
    kv[new_slots] = float("nan")  # the new tokens' latents: written by the call
    rows = t + decode
    args = [torch.randn(rows, heads * (nope + rope), generator=gen), torch.randn(rows, rank + rope, generator=gen),
            torch.randn(rank, generator=gen), 1e-6, torch.randn(rows, rope // 2, generator=gen),
            torch.randn(rows, rope // 2, generator=gen), interleave, torch.randn(heads, nope, rank, generator=gen) / 8,
            torch.randn(heads, rank, v, generator=gen) / 8]
    got_kv, want_kv = kv.clone(), kv.clone()
    got = mla_fused(*args, got_kv, new_slots, tables, lens_t, 0.125, page, chunk_table, start)
    want = ref_mla_fused(*args, want_kv, new_slots, tables, lens_t, 0.125, page, chunk_table, start)
    assert got.shape == (rows, heads * v) and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="outside the pool's"):
        mla_fused(*args, got_kv, new_slots + kv.shape[0], tables, lens_t, 0.125, page, chunk_table, start)
    if chunk:
        with pytest.raises(RuntimeError, match="no chunk"):
            mla_fused(*args, got_kv, new_slots, tables, lens_t, 0.125, page)
        with pytest.raises(RuntimeError, match="does not fit a block table"):
            mla_fused(*args, got_kv, new_slots, tables, lens_t, 0.125, page, chunk_table[:1], start + page)


# umbrella headers that pull in all of ATen (torch/types.h ~10 s of every source's build,
# torch/extension.h ~27 s): the sources include ATen/core/Tensor.h and the ATen/ops/<op>.h they call
WHOLE_TORCH_HEADERS = ("torch/extension.h", "torch/types.h", "torch/all.h", "torch/torch.h", "ATen/ATen.h",
                       "ATen/Functions.h")


def test_the_kernel_sources_include_no_umbrella_header():
    csrc = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
    sources = sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.h"))
    assert len(sources) >= 4
    found = [(f.name, h) for f in sources for line in f.read_text().splitlines() if line.startswith("#include")
             for h in WHOLE_TORCH_HEADERS if f"<{h}>" in line]
    assert found == []
