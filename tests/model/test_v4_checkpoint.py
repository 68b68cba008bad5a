"""DeepSeek-V4 checkpoints as the Hub publishes them: names, fp8 projections and fp4 routed experts
with their ``.scale`` grids (dequantized at load), the MTP layer (``mtp.*``), and what a bad one
is told."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import CheckpointError, load_model, random_state_dict, save_checkpoint
from model.config import load_config, named_config
from model.v4.checkpoint import dequantize

FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _fp4(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random e2m1 codes for a [N, K] weight, packed two a byte (low nibble first), an e8m0 scale
    per 32 columns as bytes, and the weight they stand for."""
    n, k = w.shape
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    exps = torch.randint(120, 127, (n, k // 32), generator=gen, dtype=torch.uint8)
    value = torch.tensor(FP4)[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, exps, value


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 weights with one fp32 scale per 16x16 block, and the weight they stand for."""
    n, k = w.shape
    scale = torch.rand(n // 16, k // 16) + 0.5
    q = (w / scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)


def test_fp8_projections_and_fp4_experts_load_as_the_weights_they_stand_for(tmp_path):
    cfg = named_config("tiny-v4")
    sd = random_state_dict(cfg, seed=3, std=0.1)
    gen = torch.Generator().manual_seed(4)
    stored, dense = dict(sd), dict(sd)
    for name in ("layers.1.attn.wq_a.weight", "layers.2.attn.wkv.weight"):
        q, scale, value = _fp8(sd[name])
        stored[name], stored[name[: -len(".weight")] + ".scale"], dense[name] = q, scale, value
    for e in range(cfg.n_routed_experts):
        for w in ("w1", "w2", "w3"):
            name = f"layers.3.ffn.experts.{e}.{w}.weight"
            packed, exps, value = _fp4(sd[name], gen)
            stored[name], stored[name[: -len(".weight")] + ".scale"], dense[name] = packed, exps, value
    (tmp_path / "q").mkdir()
    save_file({k: v.contiguous() for k, v in stored.items()}, str(tmp_path / "q" / "model.safetensors"))
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_checkpoint(tmp_path / "dense", cfg, dense)
    ids = torch.randint(0, cfg.vocab_size, (80,), generator=gen)
    logits = []
    for ckpt in ("q", "dense"):
        model = load_model(tmp_path / ckpt)
        logits.append(model.prefill(ids, model.new_pool(6, 16), torch.arange(6)))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_a_scale_grid_that_does_not_tile_its_weight_is_refused():
    with pytest.raises(CheckpointError, match="do not tile"):
        dequantize(torch.zeros(4, 48, dtype=torch.float8_e4m3fn), torch.ones(3, 1), "layers.0.attn.wq_a.weight")


def test_transformers_names_are_read_and_a_stray_tensor_is_named(tmp_path):
    cfg = named_config("tiny-v4")
    sd = random_state_dict(cfg, seed=1)
    renamed = {("model.embed_tokens.weight" if k == "embed.weight" else "model." + k if k.startswith("layers.")
                else k).replace(".attn.kv_norm.", ".attn.norm."): v for k, v in sd.items()}
    assert any(k.endswith(".attn.norm.weight") for k in renamed)  # as transformers saves the Hub's kv_norm
    save_checkpoint(tmp_path / "hf", cfg, renamed)
    assert load_model(tmp_path / "hf").cfg == cfg
    save_checkpoint(tmp_path / "extra", cfg, {**sd, "layers.0.attn.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="layers.0.attn.bogus"):
        load_model(tmp_path / "extra")


def test_a_model_type_not_served_names_those_that_are(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v5"}))
    with pytest.raises(ValueError, match="deepseek_v5.*deepseek_v2.*deepseek_v3.*deepseek_v32.*deepseek_v4"):
        load_config(tmp_path)


def test_an_expert_shard_loads_v4_experts_with_their_clip(tmp_path):
    """What an expert shard reads (``load_expert_slots``): a V4 layer's chosen experts, as the
    model holds them, with the SwiGLU clip."""
    from model.checkpoint import load_expert_slots

    cfg = named_config("tiny-v4")
    ckpt = save_checkpoint(tmp_path / "v4", cfg, random_state_dict(cfg, seed=2))
    local = load_model(ckpt).moe_layers()[0].executor.layers[1]
    got = load_expert_slots(ckpt, {1: [5, 0, 5]})[1]
    assert got.limit == cfg.swiglu_limit
    assert torch.equal(got.gate_up, local.gate_up[[5, 0, 5]]) and torch.equal(got.down, local.down[[5, 0, 5]])


def test_a_v4_checkpoints_mtp_layer_loads_when_asked_and_its_experts_on_a_shard(tmp_path):
    """``mtp.0.*`` (a sliding-window, top-k routed block): loaded with ``mtp=True`` only, its
    window rows in the pool after the model's layers (resume records and handoffs with them), its
    experts where an expert shard asks for layer L; a checkpoint that dropped it loads without,
    half of one is named."""
    import dataclasses

    from model.checkpoint import load_expert_slots
    from model.kv_sizes import kv_sizes
    from model.weights_id import stored_mtp_layers, tensor_names

    cfg = dataclasses.replace(named_config("tiny-v4"), num_nextn_predict_layers=1)
    sd = random_state_dict(cfg, seed=5)
    ckpt = save_checkpoint(tmp_path / "v4", cfg, sd)
    plain, drafting = load_model(ckpt), load_model(ckpt, mtp=True)
    assert plain.mtp == [] and len(drafting.mtp) == 1 and stored_mtp_layers(cfg, tensor_names(ckpt)) == 1
    layers = cfg.num_hidden_layers
    assert plain.new_pool(2).planes["swa"].shape[0] == layers
    assert drafting.new_pool(2).planes["swa"].shape[0] == layers + 1
    assert drafting.new_pool(2).resume_dim > plain.new_pool(2).resume_dim
    assert kv_sizes(cfg, draft_layers=1).resume_bytes > kv_sizes(cfg).resume_bytes
    assert drafting.mtp[0].layer.attn.kind == "sliding_attention" and drafting.mtp[0].layer.attn.ratio == 0
    ids = torch.arange(70) % 256
    a = plain.prefill(ids, plain.new_pool(5), torch.arange(5))
    b = drafting.prefill(ids, drafting.new_pool(5), torch.arange(5))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # a resume record (and a handoff) carries the MTP layer's window rows with the model's
    pool, table = drafting.new_pool(5), torch.arange(5)
    _, streams = drafting.prefill(ids, pool, table, hidden=True)
    drafting.draft_chunk(0, streams[:-1], ids[1:], pool, table, 0)
    other = drafting.new_pool(5)
    other.write_resume(table, 64, pool.read_resume(table, 64))
    rows = torch.arange(64 - cfg.sliding_window, 64)
    assert pool.planes["swa"][layers, rows].abs().sum() > 0
    torch.testing.assert_close(other.planes["swa"][:, rows], pool.planes["swa"][:, rows], atol=0, rtol=0)
    shard = load_expert_slots(ckpt, {layers: [3, 1]})[layers]
    held = drafting.moe_layers()[0].executor.layers[layers]
    assert torch.equal(shard.gate_up, held.gate_up[[3, 1]]) and torch.equal(shard.down, held.down[[3, 1]])

    dropped = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    save_checkpoint(tmp_path / "dropped", cfg, dropped)
    assert load_model(tmp_path / "dropped", mtp=True).mtp == []
    save_checkpoint(tmp_path / "half", cfg, {**dropped, "mtp.0.e_proj.weight": sd["mtp.0.e_proj.weight"]})
    with pytest.raises(CheckpointError, match="missing tensor 'mtp.0."):
        load_model(tmp_path / "half", mtp=True)
    assert load_model(tmp_path / "half").mtp == []  # not asked for: not read


def test_the_v4_draft_mixes_the_next_tokens_embedding_into_every_stream_and_rows_equal_a_chunk(tmp_path):
    """MTP layer 0's input is e_proj(enorm(embed(next))) + h_proj(hnorm(stream)) on each of the
    model's last streams; drafted a row at a time (decode) it gives a prompt chunk's drafts, and
    chained it reads its own output streams."""
    import dataclasses

    import torch.nn.functional as F

    from model.checkpoint import build_model

    cfg = dataclasses.replace(named_config("tiny-v4"), num_nextn_predict_layers=1)
    model = build_model(cfg, random_state_dict(cfg, seed=6, std=0.1))
    mtp, eps = model.mtp[0], cfg.rms_norm_eps
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=gen)  # past the window (32) and an HCA window (64)
    table = torch.arange(8)
    pool = model.new_pool(8, 16)
    _, streams = model.prefill(ids, pool, table, hidden=True)
    assert streams.shape == (90, cfg.hc_mult, cfg.hidden_size)
    e = F.rms_norm(model.embed[ids[1:3]], (cfg.hidden_size,), mtp.enorm, eps) @ mtp.e_proj.T
    h = F.rms_norm(streams[:2], (cfg.hidden_size,), mtp.hnorm, eps) @ mtp.h_proj.T
    torch.testing.assert_close(mtp.inputs(model.embed, streams[:2], ids[1:3], eps), e[:, None] + h)
    # the chunk's drafts at positions 0..88 (the token after each known), then position 89 as a row
    whole, _ = model.draft_chunk(0, streams[:89], ids[1:90], pool, table, 0)
    chunk_pool = model.new_pool(8, 16)
    model.prefill(ids, chunk_pool, table)
    model.draft_chunk(0, streams[:60], ids[1:61], chunk_pool, table, 0)
    rows = [model.draft(0, streams[p : p + 1], ids[p + 1 : p + 2], chunk_pool, table[None], torch.tensor([p]))
            for p in range(60, 89)]
    torch.testing.assert_close(rows[-1][0][0], whole, atol=1e-4, rtol=1e-4)
    # chained: a draft after the last position reads the layer's output streams there
    nxt = whole.argmax()
    logits, out = model.draft(0, rows[-1][1], nxt[None], chunk_pool, table[None], torch.tensor([89]))
    assert logits.shape == (1, cfg.vocab_size) and out.shape == (1, cfg.hc_mult, cfg.hidden_size)
    assert torch.isfinite(logits).all()
