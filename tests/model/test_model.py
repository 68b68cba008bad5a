"""Engine-facing model API: cached-prefix prefill, batched ragged decode, naive vs absorbed."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import build_model, random_state_dict
from model.config import ModelConfig, named_config
from model.model import DeepseekModel


@pytest.fixture(scope="module")
def model():
    cfg = named_config("tiny")
    return build_model(cfg, random_state_dict(cfg, seed=3, std=0.08))


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cached", [64, 128])
def test_prefill_after_cached_prefix_equals_full_prefill(model, cached):
    ids = _ids(200)
    full_pool = model.new_pool(16, 16)
    full = model.prefill(ids, full_pool, torch.arange(16), all_logits=True)
    # a different sequence layout: scattered pages; the prefix latents copied in as whole pages
    table = torch.tensor([9, 3, 14, 0, 7, 1, 12, 5, 2, 10, 4, 6, 8, 11, 13])
    pool = model.new_pool(16, 16)
    n_pages = cached // 16
    pool.write_pages(table[:n_pages], full_pool.read_pages(torch.arange(n_pages)))
    part = model.prefill(ids[cached:], pool, table, start=cached, all_logits=True)
    torch.testing.assert_close(part, full[cached:], atol=1e-5, rtol=0)
    # and the new latents land where a full prefill puts them
    torch.testing.assert_close(pool.read_pages(table[:12]), full_pool.read_pages(torch.arange(12)))


def test_batched_ragged_decode_matches_single_sequences(model):
    lengths = [1, 17, 64, 33]
    pool = model.new_pool(40, 16)
    tables = torch.arange(40).view(4, 10)
    singles = []
    for j, n in enumerate(lengths):
        ids = _ids(n, seed=j)
        model.prefill(ids, pool, tables[j])
        own = model.new_pool(10, 16)
        model.prefill(ids, own, torch.arange(10))
        singles.append(model.decode(torch.tensor([7]), own, torch.arange(10)[None], torch.tensor([n])))
    batched = model.decode(torch.tensor([7] * 4), pool, tables, torch.tensor(lengths))
    torch.testing.assert_close(batched, torch.cat(singles), atol=1e-5, rtol=0)


def test_absorbed_and_naive_decode_agree(model):
    pool = model.new_pool(20, 16)
    tables = torch.arange(20).view(2, 10)
    for j, n in enumerate([40, 90]):
        model.prefill(_ids(n, seed=10 + j), pool, tables[j])
    snapshot = pool.data.clone()
    a = model.decode(torch.tensor([5, 6]), pool, tables, torch.tensor([40, 90]), attn="absorbed")
    pool.data.copy_(snapshot)
    b = model.decode(torch.tensor([5, 6]), pool, tables, torch.tensor([40, 90]), attn="naive")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [2, 5])
def test_two_micro_batches_equal_one_batch(model, batch):
    pool = model.new_pool(10 * batch, 16)
    tables = torch.arange(10 * batch).view(batch, 10)
    lengths = [20 + 31 * j for j in range(batch)]
    for j, n in enumerate(lengths):
        model.prefill(_ids(n, seed=30 + j), pool, tables[j])
    snapshot = pool.data.clone()
    tokens, positions = torch.arange(batch) + 3, torch.tensor(lengths)
    one = model.decode(tokens, pool, tables, positions)
    after_one = pool.data.clone()
    pool.data.copy_(snapshot)
    two = model.decode(tokens, pool, tables, positions, micro_batches=2)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.data, after_one, atol=1e-5, rtol=0)  # same latents written
    with pytest.raises(ValueError, match="micro_batches must be 1 or 2, got 3"):
        model.decode(tokens, pool, tables, positions, micro_batches=3)


def test_prefill_rejects_a_block_table_too_small(model):
    with pytest.raises(ValueError, match="block table"):
        model.prefill(_ids(40), model.new_pool(4, 16), torch.arange(2))


def test_pool_page_size_must_divide_the_cache_unit():
    with pytest.raises(ValueError, match="page_size"):
        named = named_config("tiny")
        from model.kv_cache import LatentKVPool

        LatentKVPool(named, 4, page_size=24)


def test_bf16_model_runs_and_tracks_fp32(model):
    cfg = named_config("tiny")
    sd = random_state_dict(cfg, seed=3, std=0.08)
    bf = build_model(cfg, {k: (v if "mlp.gate." in k else v.bfloat16()) for k, v in sd.items()})
    ids = _ids(30)
    ref = model.prefill(ids, model.new_pool(2, 16), torch.arange(2))
    got = bf.prefill(ids, bf.new_pool(2, 16), torch.arange(2))
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_config_validation_names_the_bad_value():
    base = named_config("tiny")
    with pytest.raises(ValueError, match="n_group=3"):
        ModelConfig(**{**_fields(base), "n_group": 3})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(**{**_fields(base), "model_type": "llama"})
    with pytest.raises(ValueError, match="unknown model config 'huge'"):
        named_config("huge")


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_auto_attention_takes_the_path_with_fewer_flops():
    """A short suffix after a long cached prefix attends absorbed; a long chunk of a chunked
    prefill attends naive even after earlier chunks (absorbed costs ~3x more per query-key pair
    at DeepSeek-V3's dims: 2R+P = 1,088 against N+P+V = 320)."""
    import dataclasses

    from model.config import named_config
    from model.mla import absorbed_pays

    v3 = dataclasses.replace(named_config("bench"), qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             kv_lora_rank=512)
    assert absorbed_pays(v3, 1, 32768) and absorbed_pays(v3, 128, 32768)
    assert not absorbed_pays(v3, 2048, 4096) and not absorbed_pays(v3, 2048, 32768)  # chunk 2 and chunk 16
    assert not absorbed_pays(v3, 512, 512)  # a fresh prompt


def test_a_chunked_prefill_equals_one_prefill(model):
    """Chunks after the first (which now attend naive when long) give the same logits as the
    whole prompt at once."""
    ids = torch.randint(0, model.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    pool = model.new_pool(32, 16)
    table = torch.arange(16)
    whole = model.prefill(ids, pool, table)
    pool2 = model.new_pool(32, 16)
    for lo in range(0, 200, 80):
        last = model.prefill(ids[lo : lo + 80], pool2, table, start=lo)
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t", [1, 5, 16, 40])
def test_chunks_after_a_prefix_read_the_pool_in_place_and_equal_one_prefill(model, t, monkeypatch):
    """An absorbed chunk after a prefix attends over the pages in place (no gather of the
    prefix, no [T, S] mask): on the CPU all its queries in the layer's one fused call (the
    chunk's rows only), with Triton a short chunk's queries as decode rows of their own lengths;
    the logits are those of the whole prompt at once."""
    from model.mla import MLA, MQA_MAX_QUERIES

    calls = []
    for name in ("attend_paged", "attend_fused"):
        real = getattr(MLA, name)
        monkeypatch.setattr(MLA, name, lambda self, q, *a, _real=real, _name=name, **k:
                            calls.append((_name, q.shape[0])) or _real(self, q, *a, **k))
    ids = _ids(150, seed=t)
    whole = model.prefill(ids, model.new_pool(16, 16), torch.arange(16), all_logits=True)
    pool, table = model.new_pool(16, 16), torch.tensor([5, 0, 9, 2, 14, 7, 1, 11, 3, 15])
    model.prefill(ids[:100], pool, table)
    got = [model.prefill(ids[lo : lo + t], pool, table, start=lo, all_logits=True) for lo in range(100, 150, t)]
    torch.testing.assert_close(torch.cat(got)[:50], whole[100:], atol=1e-4, rtol=1e-4)
    if model.paged_kernel == "cpu":
        assert calls and set(calls) <= {("attend_fused", t), ("attend_fused", 50 % t)}, calls
    elif model.paged_kernel == "triton" and t <= MQA_MAX_QUERIES:
        assert calls and set(calls) <= {("attend_paged", t), ("attend_paged", 50 % t)}, calls  # a row per query


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("chunk_start", [0, 64])
def test_a_mixed_step_equals_a_prefill_and_a_decode(model, chunk_start, micro_batches):
    """A prefill chunk and a decode batch in one forward pass (or as its two pipelined
    micro-batches) give the logits and write the latents that the two calls give apart (the
    chunk after a cached start or from token 0)."""
    lengths = [5, 33, 70]
    pool = model.new_pool(64, 16)
    tables = torch.arange(30).view(3, 10)
    for j, n in enumerate(lengths):
        model.prefill(_ids(n, seed=40 + j), pool, tables[j])
    chunk_table = torch.arange(30, 40)
    ids = _ids(chunk_start + 50, seed=50)
    if chunk_start:
        model.prefill(ids[:chunk_start], pool, chunk_table)
    snapshot = pool.data.clone()
    tokens, positions = torch.tensor([3, 4, 5]), torch.tensor(lengths)
    want_chunk = model.prefill(ids[chunk_start:], pool, chunk_table, start=chunk_start)
    want_batch = model.decode(tokens, pool, tables, positions)
    want_pool = pool.data.clone()
    pool.data.copy_(snapshot)
    got_chunk, got_batch = model.mixed(ids[chunk_start:], chunk_table, chunk_start, tokens, tables, positions, pool,
                                       micro_batches=micro_batches)
    torch.testing.assert_close(got_chunk, want_chunk, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_batch, want_batch, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.data, want_pool, atol=1e-5, rtol=0)


@pytest.mark.parametrize("interleave", [False, True])
def test_a_cpu_decode_pass_is_one_fused_call_per_layer_and_equals_the_unfused_path(interleave, monkeypatch):
    """On a float32 CPU model a decode pass of its own, layer by layer in Python (the whole C++
    step off: tests/model/test_cpu_step.py), runs each layer's attention past its projections as
    one C++ call (RoPE, the latent's norm and write, W_UK, paged attention, W_UV): the logits and
    the latents it writes equal those of the op-by-op paged path."""
    import dataclasses

    from model.mla import MLA

    cfg = dataclasses.replace(named_config("tiny"), rope_interleave=interleave)
    m = build_model(cfg, random_state_dict(cfg, seed=5, std=0.08))
    if m.paged_kernel != "cpu":
        pytest.skip("the CPU kernels are not built")
    m.cpu_step = False
    lengths = [1, 17, 64, 90]
    pool, tables = m.new_pool(48, 16), torch.arange(28).view(4, 7)
    for j, n in enumerate(lengths):
        m.prefill(_ids(n, seed=60 + j), pool, tables[j])
    snapshot = pool.data.clone()
    calls = []
    real = MLA.attend_fused
    monkeypatch.setattr(MLA, "attend_fused", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    tokens, positions = torch.tensor([3, 4, 5, 6]), torch.tensor(lengths)
    got = m.decode(tokens, pool, tables, positions)
    got_pool = pool.data.clone()
    assert len(calls) == cfg.num_hidden_layers
    pool.data.copy_(snapshot)
    monkeypatch.setattr(DeepseekModel, "_forward", _unfused_forward)
    want = m.decode(tokens, pool, tables, positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_pool, pool.data, atol=1e-6, rtol=0)


def _unfused_forward(self, pool, chunk, batch):
    """``DeepseekModel._forward`` of a decode batch op by op (as a mixed pass takes it)."""
    from model.layers import rms_norm

    h = batch.h
    for i, layer in enumerate(self.layers):
        x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
        q_nope, q_rope, latent, _ = layer.attn.project(x, batch.cos, batch.sin)
        pool.write(i, batch.new_slots, latent)
        h = self._ffn(layer, h + layer.attn.output(batch.attend(i, layer.attn, q_nope, q_rope, pool)))
    return h


def test_small_ops_keep_their_gradients():
    """The C++ kernels (decode-sized linear, RMSNorm, routing) have no backward: with autograd
    recording, the same calls take torch's path and give torch's gradients."""
    import torch.nn.functional as F

    from kernels.cpu_gemv import ref_moe_route
    from model.layers import linear, rms_norm
    from model.moe import Gate, route

    cfg = named_config("bench")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, cfg.hidden_size, generator=gen, requires_grad=True)
    w = torch.randn(32, cfg.hidden_size, generator=gen, requires_grad=True)
    norm = torch.randn(cfg.hidden_size, generator=gen, requires_grad=True)
    gate = Gate(torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=gen, requires_grad=True),
                torch.randn(cfg.n_routed_experts, generator=gen))

    def ours():
        return linear(rms_norm(x, norm, 1e-6), w).square().sum() + route(cfg, gate, x)[1].sum()

    def torchs():
        logits = F.linear(x, gate.weight)
        weights = ref_moe_route(logits, gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                cfg.topk_group, cfg.topk_method, False, cfg.norm_topk_prob,
                                cfg.routed_scaling_factor)[1]
        return F.linear(F.rms_norm(x, norm.shape, norm, 1e-6), w).square().sum() + weights.sum()

    grads = [torch.autograd.grad(f(), (x, w, norm, gate.weight)) for f in (ours, torchs)]
    for a, b in zip(*grads, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)
