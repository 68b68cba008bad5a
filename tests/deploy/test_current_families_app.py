"""The Serve app (what ``tide up`` deploys) serving a DeepSeek-V3.2 and a DeepSeek-V4 checkpoint
as transformers writes them: through HTTP, cold and from the prompt cache, the tokens are
transformers' greedy ones. V4's app splits prefill and decode (P/D): its prompts' KV (entry pages
and the window state at their end) crosses to a decode replica."""

from __future__ import annotations

import httpx
import pytest
import torch

from model.tokenizer import ByteTokenizer
from tests.model.hf_checkpoints import make_hf_checkpoint

pytestmark = pytest.mark.ray

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["v32_sparse_yarn", "v4_hybrid_yarn"])
def served(request, local_ray, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, home / "ckpt", seed=11)
    split = {"replicas": 1, "decode_replicas": 1, "replica_cpus": 0.5} if request.param.startswith("v4") else {}
    app = build_app({"checkpoint": str(home / "ckpt"), "model_name": request.param, "cache_dir": str(home / "cache"),
                     "replica_cpus": 1, "num_pages": 128, **split})
    with serving(app, 120) as url:
        yield hf, request.param, url


def test_cold_and_cached_completions_are_transformers_greedy_tokens(served):
    hf, name, url = served
    prompt = torch.randint(2, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, 150, dtype=torch.long), max_new_tokens=16,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 150:].tolist()
    body = {"model": name, "prompt": prompt.tolist(), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    cold, hit = (httpx.post(url + "/v1/completions", json=body, timeout=120).json() for _ in range(2))
    text = ByteTokenizer().decode(want)
    assert cold["choices"][0]["text"] == text and hit["choices"][0]["text"] == text
    assert cold["usage"]["prompt_cache_hit_tokens"] == 0
    assert hit["usage"]["prompt_cache_hit_tokens"] == 128  # two whole units of the 150-token prompt
