"""The Serve app (what ``tide up`` deploys) serving a DeepSeek-V3.2 and a DeepSeek-V4 checkpoint
as transformers writes them: through HTTP, cold and from the prompt cache, the tokens are
transformers' greedy ones. V4's app splits prefill and decode (P/D): its prompts' KV (entry pages
and the window state at their end) crosses to a decode replica, which drafts with the MTP layer
DeepSeek's V4 checkpoints store (``mtp.0.*``, added to what transformers writes)."""

from __future__ import annotations

import httpx
import pytest
import torch

from model.dsml import DSML_FORMATS, render_dsml
from model.tokenizer import load_tokenizer
from tests.model.hf_checkpoints import add_v4_mtp_layer, make_hf_checkpoint

pytestmark = pytest.mark.ray

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["v32_sparse_yarn", "v4_hybrid_yarn"])
def served(request, local_ray, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, home / "ckpt", seed=11)
    _word_tokenizer(home / "ckpt", hf.config.vocab_size)  # DeepSeek's chat tokens, no template: the encoding renders
    split = {}
    if request.param.startswith("v4"):
        add_v4_mtp_layer(home / "ckpt", seed=12)
        split = {"replicas": 1, "decode_replicas": 1, "replica_cpus": 0.5, "speculative_tokens": 2}
    app = build_app({"checkpoint": str(home / "ckpt"), "model_name": request.param, "cache_dir": str(home / "cache"),
                     "replica_cpus": 1, "num_pages": 128, **split})
    with serving(app, 120) as url:
        yield hf, request.param, url, home / "ckpt"


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


def _word_tokenizer(ckpt, vocab: int) -> None:
    """A word-level tokenizer of fewer than ``vocab`` tokens with DeepSeek's chat tokens (the
    checkpoints' random models read ids below ``vocab`` only)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", *SPECIALS, "Tide", "at", "Brest", "?", "high", "low"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() < vocab
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}))


def test_cold_and_cached_completions_are_transformers_greedy_tokens(served):
    hf, name, url, _ = served
    prompt = torch.randint(2, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, 150, dtype=torch.long), max_new_tokens=16,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 150:].tolist()
    body = {"model": name, "prompt": prompt.tolist(), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    cold, hit = (httpx.post(url + "/v1/completions", json=body, timeout=120).json() for _ in range(2))
    text = load_tokenizer(served[3]).decode(want)
    assert cold["choices"][0]["text"] == text and hit["choices"][0]["text"] == text
    assert cold["usage"]["prompt_cache_hit_tokens"] == 0
    assert hit["usage"]["prompt_cache_hit_tokens"] == 128  # two whole units of the 150-token prompt
    if name.startswith("v4"):  # the decode replica drafted (a random MTP layer: its drafts are rejected)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        drafted = [float(x.split()[-1]) for x in metrics.splitlines()
                   if x.startswith("tide:spec_decode_num_draft_tokens_total")]
        assert drafted and drafted[0] > 0, metrics[-3000:]


def test_a_chat_is_rendered_by_the_models_encoding_with_thinking_and_tools(served):
    """A V3.2 or V4 checkpoint without a chat template: the chat route renders its messages by
    that model's encoding rules, thinking on as chat_template_kwargs asks, tools in the system
    prompt (the prompt's ids, read back from its prompt logprobs, are that text's)."""
    hf, name, url, ckpt = served
    messages = [{"role": "user", "content": "Tide at Brest ?"}]
    tools = [{"type": "function", "function": {"name": "tide", "parameters": {"type": "object"}}}]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": name, "messages": messages, "tools": tools, "max_tokens": 1, "temperature": 0,
        "chat_template_kwargs": {"thinking": True}, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    got = [int(next(iter(p))) if p else None for p in r.json()["prompt_logprobs"]]
    tok = load_tokenizer(ckpt)
    fmt = DSML_FORMATS["v4" if name.startswith("v4") else "v3.2"]
    want = tok.encode(render_dsml(fmt, messages, tools, thinking=True))
    assert got[1:] == want[1:] and want[-2:] == [tok.encode(t)[0] for t in ("<｜Assistant｜>", "<think>")]
