"""Checkpoint loading: sharded and single files, and clear errors on every mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import CheckpointError, load_model, random_state_dict, save_checkpoint
from model.config import named_config


@pytest.fixture()
def tiny_sd():
    return random_state_dict(named_config("tiny"), seed=1)


def _logits(m):
    return m.prefill(torch.arange(20), m.new_pool(2, 16), torch.arange(2))


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_sd):
    cfg = named_config("tiny")
    single = save_checkpoint(tmp_path / "single", cfg, tiny_sd)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((single / "config.json").read_text())
    names = sorted(tiny_sd)
    weight_map = {}
    for i, chunk in enumerate([names[: len(names) // 2], names[len(names) // 2 :]]):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tiny_sd[n] for n in chunk}, str(sharded / fname))
        weight_map.update({n: fname for n in chunk})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    seen = []
    a = load_model(single)
    b = load_model(sharded, progress=seen.append)
    torch.testing.assert_close(_logits(a), _logits(b), atol=1e-5, rtol=0)
    stored = sum(t.numel() * t.element_size() for t in tiny_sd.values())
    assert seen[-1] == (len(names), len(names), stored, stored, 2, 2)
    shards = [p.shards for p in seen]
    assert shards == sorted(shards) and shards[0] == 0 and 1 in shards  # a shard counts once read whole
    assert all(a.bytes < b.bytes for a, b in zip(seen, seen[1:], strict=False))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda sd: sd.pop("model.layers.2.mlp.experts.5.up_proj.weight"), "missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"),
        (lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(3, 3)), "'model.layers.0.self_attn.o_proj.weight' has shape"),
        (lambda sd: sd.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(2)), "unexpected tensor 'model.layers.1.mlp.extra.weight'"),
    ],
)
def test_mismatched_checkpoint_is_a_clear_error(tmp_path, tiny_sd, mutate, message):
    mutate(tiny_sd)
    ckpt = save_checkpoint(tmp_path / "bad", named_config("tiny"), tiny_sd)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(ckpt)


def test_mtp_layers_after_the_last_layer_are_ignored(tmp_path, tiny_sd):
    tiny_sd["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)  # V3's multi-token prediction
    load_model(save_checkpoint(tmp_path / "mtp", named_config("tiny"), tiny_sd))


def test_unsupported_model_type_and_missing_files(tmp_path, tiny_sd):
    ckpt = save_checkpoint(tmp_path / "c", named_config("tiny"), tiny_sd)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_model(ckpt)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(ckpt, "int8")
