"""``ExpertShard`` (the plain class the expert-shard actor wraps) loads a DeepSeek-V4 checkpoint's
experts for its slots with the SwiGLU clip, and computes what the model's own experts do."""

from __future__ import annotations

import torch

from actors.expert_shard import ExpertShard
from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import named_config


def test_a_shard_holds_v4_experts_with_their_clip_and_computes_the_models_rows(tmp_path):
    cfg = named_config("tiny-v4")
    ckpt = save_checkpoint(tmp_path / "v4", cfg, random_state_dict(cfg, seed=4, std=0.5))
    local = load_model(ckpt).moe_layers()[0].executor.layers[2]
    shard = ExpertShard()
    counts = shard.load(0, {2: [7, 3, 7]}, list(range(cfg.num_hidden_layers)), str(ckpt))
    assert counts == {"local": 0, "peer": 0, "checkpoint": 3}
    held = shard.experts.layer(0, 2)
    assert held.limit == cfg.swiglu_limit
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 4  # some values clip
    slots = torch.tensor([0, 1, 2, 1, 0])
    want = torch.stack([
        torch.nn.functional.linear(torch.nn.functional.silu(g.clamp(max=cfg.swiglu_limit)) * u.clamp(
            -cfg.swiglu_limit, cfg.swiglu_limit), local.down[e])
        for e, row in zip([7, 3, 7, 3, 7], x, strict=True)
        for g, u in [torch.nn.functional.linear(row, local.gate_up[e]).chunk(2)]])
    torch.testing.assert_close(shard.experts.compute(0, 2, slots, x), want, atol=1e-3, rtol=1e-4)
