"""The checkpoint's multi-token-prediction layers: loaded as DeepSeek stores them (or not at all),
their latents in the pool beside the model's, the same drafts on every path."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.cache_identity import CacheIdentity
from model.checkpoint import CheckpointError, load_model, random_state_dict, save_checkpoint
from model.config import ModelConfig, load_config, named_config
from model.weights_id import stored_mtp_layers, tensor_names

CFG = dataclasses.replace(named_config("tiny"), num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", CFG, random_state_dict(CFG, seed=3, std=0.1))


def test_the_config_names_its_mtp_layers_and_configs_without_stay_as_they_were(ckpt):
    assert load_config(ckpt).num_nextn_predict_layers == 1
    assert "num_nextn_predict_layers" not in named_config("tiny").to_hf_dict()
    assert CFG.fingerprint() != named_config("tiny").fingerprint()
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        ModelConfig.from_hf_dict({**CFG.to_hf_dict(), "num_nextn_predict_layers": -1})


def test_mtp_layers_load_when_asked_and_live_after_the_models_layers_in_the_pool(ckpt):
    plain, drafting = load_model(ckpt), load_model(ckpt, mtp=True)
    assert plain.mtp == [] and len(drafting.mtp) == 1
    assert plain.new_pool(2).num_layers == CFG.num_hidden_layers
    assert drafting.new_pool(2).num_layers == CFG.num_hidden_layers + 1
    # the MTP layer's embedding and head are the model's (the checkpoint stores none of its own)
    assert drafting.mtp[0].embed is drafting.embed and drafting.mtp[0].lm_head is drafting.lm_head
    # the model's own logits do not change with the MTP layer loaded
    ids = torch.arange(40) % 256
    a = plain.prefill(ids, plain.new_pool(4), torch.arange(4))
    b = drafting.prefill(ids, drafting.new_pool(4), torch.arange(4))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_deepseeks_layout_with_the_mtp_layers_own_embedding_and_head(ckpt, tmp_path):
    sd = load_file(str(ckpt / "model.safetensors"))
    p = f"model.layers.{CFG.num_hidden_layers}."
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[p + "shared_head.head.weight"] = torch.randn_like(sd["lm_head.weight"])
    own = save_checkpoint(tmp_path / "own", CFG, sd)
    model = load_model(own, mtp=True)
    torch.testing.assert_close(model.mtp[0].lm_head, sd[p + "shared_head.head.weight"])
    assert model.mtp[0].lm_head is not model.lm_head


def test_a_checkpoint_that_declares_mtp_but_dropped_it_loads_without(ckpt, tmp_path):
    sd = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items()
          if not k.startswith(f"model.layers.{CFG.num_hidden_layers}.")}
    dropped = save_checkpoint(tmp_path / "dropped", CFG, sd)
    assert stored_mtp_layers(CFG, tensor_names(dropped)) == 0 and stored_mtp_layers(CFG, tensor_names(ckpt)) == 1
    assert load_model(dropped, mtp=True).mtp == []
    # half an MTP layer is a broken checkpoint, named
    half = {**sd, f"model.layers.{CFG.num_hidden_layers}.eh_proj.weight": torch.zeros(256, 512)}
    save_file(half, str(tmp_path / "dropped" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_model(dropped, mtp=True)


def test_units_with_mtp_latents_have_a_cache_namespace_of_their_own(ckpt, tmp_path):
    on = CacheIdentity(str(ckpt), speculative=True).namespace()
    off = CacheIdentity(str(ckpt)).namespace()
    assert on.kv_layout.endswith("+mtp:1") and on.id != off.id
    plain = save_checkpoint(tmp_path / "plain", named_config("tiny"), random_state_dict(named_config("tiny"), seed=3))
    assert CacheIdentity(str(plain), speculative=True).namespace().kv_layout == named_config("tiny").kv_layout
    assert json.loads((plain / "config.json").read_text()).get("num_nextn_predict_layers") is None


def test_the_draft_is_the_same_in_one_cpp_call_and_layer_by_layer(ckpt):
    """The MTP layer's pass (two rows of one sequence and one of another) through the C++ step
    and through the Python layers; the hidden states the model hands it are those the LM head
    reads."""
    model = load_model(ckpt, mtp=True)
    pool, tables = model.new_pool(16), torch.arange(16).view(2, 8)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (30, 50)]
    hidden = []
    for row, ids in zip(tables, prompts, strict=True):
        logits, h = model.prefill(ids, pool, row, hidden=True, all_logits=True)
        torch.testing.assert_close(logits, torch.nn.functional.linear(h, model.lm_head))
        hidden.append(h)
    args = (torch.stack([hidden[0][-2], hidden[0][-1], hidden[1][-1]]), torch.tensor([5, 9, 11]))
    where = (tables[[0, 0, 1]], torch.tensor([28, 29, 49]))
    fast = model.draft(0, *args, pool, *where)
    model.cpu_step = False
    slow = model.draft(0, *args, pool, *where)
    model.cpu_step = True
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # decode(hidden=True): the same logits as without, and the normed states beside them
    tok, pos = torch.tensor([3, 4]), torch.tensor([30, 50])
    logits, h = model.decode(tok, pool, tables, pos, hidden=True)
    torch.testing.assert_close(logits, model.decode(tok, pool, tables, pos), atol=0, rtol=0)
    assert h.shape == (2, CFG.hidden_size)


def test_a_verify_pass_and_its_drafts_in_one_call_are_the_two_passes(ckpt):
    """``verify_draft``: the verify pass's logits and hidden states, each row's argmax, and MTP
    layer 0 over the same rows with those argmaxes as inputs, bit for bit as ``decode`` then
    ``draft`` give them, the same latents written; None where the C++ steps do not run."""
    model = load_model(ckpt, mtp=True)
    pool, tables = model.new_pool(16), torch.arange(16).view(2, 8)
    gen = torch.Generator().manual_seed(1)
    for row, n in zip(tables, (30, 50), strict=True):
        model.prefill(torch.randint(0, 256, (n,), generator=gen), pool, row)
    tok, where = torch.tensor([3, 7, 4]), (tables[[0, 0, 1]], torch.tensor([30, 31, 50]))
    before = pool.data.clone()
    logits, hidden, guesses, drafts, normed = model.verify_draft(tok, pool, *where)
    one_call = pool.data.clone()
    pool.data.copy_(before)
    want_logits, want_hidden = model.decode(tok, pool, *where, hidden=True)
    draft_logits, want_normed = model.draft(0, want_hidden, want_logits.argmax(-1), pool, *where)
    for got, want in ((logits, want_logits), (hidden, want_hidden), (guesses, want_logits.argmax(-1)),
                      (drafts, draft_logits.argmax(-1)), (normed, want_normed), (one_call, pool.data)):
        assert torch.equal(got, want)
    model.cpu_step = False
    assert model.verify_draft(tok, pool, *where) is None
    model.cpu_step = True


def test_a_drafting_pools_units_are_counted_with_their_mtp_latents(ckpt):
    """What bounds a unit a peer may send (``kv_sizes``) counts the MTP layer's latents that a
    drafting replica's units carry: a unit of a drafting pool is exactly that size."""
    from cachedir.hashing import Namespace
    from cluster.engine import Engine, EngineConfig
    from model.kv_sizes import kv_sizes

    model = load_model(ckpt, mtp=True)
    eng = Engine(model, EngineConfig(num_pages=8, speculative_tokens=1), Namespace("f", "w", "float32", "l", 64),
                 lambda ids: "", None)
    assert kv_sizes(CFG, torch.float32, draft_layers=1).unit_bytes == eng.kv.unit_bytes()
    assert kv_sizes(CFG, torch.float32).unit_bytes * 5 == eng.kv.unit_bytes() * 4  # 4 layers, and the MTP one
