"""The whole CPU decode step as one C++ call (model.cpu_step): the same bits as the Python path,
no Python per layer, and the Python path wherever the C++ step cannot run the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.checkpoint import build_model, random_state_dict
from model.config import named_config
from model.mla import MLA
from model.moe import MoE
from model.quant import quantize_model

LENGTHS = [1, 17, 64, 90, 5, 33]
SHAPES = {
    "v3": {},  # q_lora path, noaux_tc sigmoid routing in groups, interleaved RoPE, a dense first layer
    "v2_lite": dict(q_lora_rank=None, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                    norm_topk_prob=False, rope_interleave=False, routed_scaling_factor=1.0),
    "v2_grouped": dict(topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False),
}


def _model(shape: str = "v3", int8: bool = False):
    cfg = dataclasses.replace(named_config("tiny"), **SHAPES[shape])
    m = build_model(cfg, random_state_dict(cfg, seed=5, std=0.08))
    if m.paged_kernel != "cpu":
        pytest.skip("the CPU kernels are not built")
    if int8:
        quantize_model(m)
    return m


def _prefilled(m, lengths=LENGTHS, spare_pages: int = 0):
    pool, tables = m.new_pool(len(lengths) * 8 + spare_pages, 16), torch.arange(len(lengths) * 8).view(len(lengths), 8)
    gen = torch.Generator().manual_seed(1)
    for row, n in zip(tables, lengths, strict=True):
        m.prefill(torch.randint(0, m.cfg.vocab_size, (n,), generator=gen), pool, row)
    return pool, tables


def _both_paths(m, pool, tables, rows: int):
    """(logits, pool after) of a decode pass of ``rows`` rows, as the model runs it and layer by
    layer in Python, from the same pool."""
    tokens, positions = torch.arange(3, 3 + rows), torch.tensor(LENGTHS[:rows])
    snapshot = pool.data.clone()
    got = m.decode(tokens, pool, tables[:rows], positions), pool.data.clone()
    pool.data.copy_(snapshot)
    m.cpu_step = False
    try:
        want = m.decode(tokens, pool, tables[:rows], positions), pool.data.clone()
    finally:
        m.cpu_step = True
        pool.data.copy_(snapshot)
    return got, want


def _no_python_layers(monkeypatch) -> list[str]:
    """Records every per-layer Python call of a decode pass (attention, MoE)."""
    calls: list[str] = []
    for cls, name in ((MLA, "attend_fused"), (MLA, "project"), (MoE, "submit")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _r=real, _n=name, **k: calls.append(_n) or _r(self, *a, **k))
    return calls


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_whole_step_gives_the_python_paths_logits_and_latents_bit_for_bit(shape, int8, monkeypatch):
    m = _model(shape, int8)
    pool, tables = _prefilled(m)
    calls = _no_python_layers(monkeypatch)
    for rows in (1, 2, len(LENGTHS)):
        calls.clear()
        (got, got_pool), (want, want_pool) = _both_paths(m, pool, tables, rows)
        assert calls.count("attend_fused") == m.cfg.num_hidden_layers  # the Python path's, not the step's
        assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    assert m._cpu_step.step is not None


def test_a_pass_runs_no_python_per_layer(monkeypatch):
    m = _model()
    pool, tables = _prefilled(m)
    calls = _no_python_layers(monkeypatch)
    m.decode(torch.arange(4), pool, tables[:4], torch.tensor(LENGTHS[:4]))
    assert calls == []


def test_larger_batches_than_the_step_takes_run_in_python(monkeypatch):
    m = _model()
    pool, tables = _prefilled(m)
    m.decode(torch.arange(1), pool, tables[:1], torch.tensor(LENGTHS[:1]))
    m._cpu_step.max_rows = 2  # past it the Python path runs (BLAS and the grouped GEMM at full size)
    calls = _no_python_layers(monkeypatch)
    (got, got_pool), (want, want_pool) = _both_paths(m, pool, tables, 3)
    assert calls.count("attend_fused") == 2 * m.cfg.num_hidden_layers
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_mixed_pass_in_the_step_gives_the_python_paths_logits_and_latents_bit_for_bit(shape, int8, monkeypatch):
    """A prefill chunk after a prefix (absorbed) beside the decode rows: the chunk's last logits,
    the rows' logits and every latent written as the Python path gives them, in one call."""
    m = _model(shape, int8)
    pool, tables = _prefilled(m, spare_pages=6)
    gen = torch.Generator().manual_seed(7)
    chunk_table = torch.arange(tables.numel(), tables.numel() + 6)
    prompt = torch.randint(0, m.cfg.vocab_size, (60,), generator=gen)
    m.prefill(prompt[:50], pool, chunk_table)
    rows = len(LENGTHS)
    args = (prompt[50:], chunk_table, 50, torch.arange(3, 3 + rows), tables[:rows], torch.tensor(LENGTHS[:rows]), pool)
    snapshot = pool.data.clone()
    calls = _no_python_layers(monkeypatch)
    got = (*m.mixed(*args), pool.data.clone())
    assert calls == []  # one C++ call
    pool.data.copy_(snapshot)
    m.cpu_step = False
    want = (*m.mixed(*args), pool.data.clone())
    assert calls.count("attend_fused") == m.cfg.num_hidden_layers
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_step_is_rebuilt_when_weights_are_replaced():
    """A step built on float32 weights is not used once the model holds int8 ones: the logits are
    the int8 model's (a stale step would give the float32 model's)."""
    m = _model()
    pool, tables = _prefilled(m)
    (fp32, _), _ = _both_paths(m, pool, tables, 3)
    first = m._cpu_step
    quantize_model(m)
    (got, _), (want, _) = _both_paths(m, pool, tables, 3)
    assert m._cpu_step is not first
    assert torch.equal(got, want) and not torch.equal(got, fp32)
    again = m._cpu_step
    m.decode(torch.arange(1), pool, tables[:1], torch.tensor(LENGTHS[:1]))
    assert m._cpu_step is again  # nothing replaced: the same step


def test_experts_outside_the_process_or_a_routing_hook_take_the_python_path(monkeypatch):
    m = _model()
    pool, tables = _prefilled(m)
    (want, _), _ = _both_paths(m, pool, tables, 3)
    local = m.moe_layers()[0].executor
    seen = []

    class Remote:  # stands in for expert parallelism's executor: the step must call it
        def __call__(self, layer_idx, x, ids, weights):
            seen.append(layer_idx)
            return local(layer_idx, x, ids, weights)

    m.set_expert_executor(Remote())
    (got, _), _ = _both_paths(m, pool, tables, 3)
    refused = m._cpu_step
    assert refused.step is None and "outside this process" in refused.why_not
    assert len(seen) == 2 * len(m.moe_layers()) and torch.equal(got, want)
    m.decode(torch.arange(1), pool, tables[:1], torch.tensor(LENGTHS[:1]))
    assert m._cpu_step is refused  # the answer is kept while nothing changes: no build per pass
    m.set_expert_executor(local)
    routes = []
    m.moe_layers()[0].on_route = lambda layer, ids: routes.append(layer)
    (got, _), _ = _both_paths(m, pool, tables, 3)
    assert m._cpu_step.step is None and routes and torch.equal(got, want)
    m.moe_layers()[0].on_route = None
    m.decode(torch.arange(1), pool, tables[:1], torch.tensor(LENGTHS[:1]))
    assert m._cpu_step.step is not None  # both put back: the step again


def test_block_tables_too_narrow_for_a_position_are_refused():
    m = _model()
    pool, tables = _prefilled(m)
    with pytest.raises(ValueError, match="block tables hold 32 tokens, need 91"):
        m.decode(torch.arange(1), pool, tables[3:4, :2], torch.tensor([90]))
