"""DeepSeek-V4 checkpoints as the Hub publishes them: names, fp8 projections and fp4 routed experts
with their ``.scale`` grids (dequantized at load), and what a bad one is told."""

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
                else k): v for k, v in sd.items()}
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


def test_asking_a_v4_checkpoint_for_mtp_drafts_says_they_do_not_run(tmp_path, caplog):
    """Its MTP layer (``mtp.*``) is not loaded: a replica or ``tide generate`` asked to draft
    decodes without drafts, and the log says so."""
    import dataclasses

    cfg = dataclasses.replace(named_config("tiny-v4"), num_nextn_predict_layers=1)
    ckpt = save_checkpoint(tmp_path / "v4", cfg, random_state_dict(cfg, seed=5))
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        assert load_model(ckpt, mtp=True).cfg == cfg
    assert "MTP layer does not draft yet" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        load_model(ckpt)
    assert "MTP" not in caplog.text
