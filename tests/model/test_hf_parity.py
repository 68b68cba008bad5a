"""tideserve's model matches transformers on small random DeepSeek-V2/V3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model
from model.generate import generate
from tests.model.hf_checkpoints import SHAPES, make_hf_checkpoint

transformers = pytest.importorskip("transformers")


# Every parity test runs with the torch path and with the Triton kernels (MLA decode over the
# paged pool, V3 routing, grouped experts, unit copies), which run in Triton's interpreter on CPU:
# about a minute in all, so the Triton half is in the slow tier (the kernel tests beside it check
# each kernel against its reference in the fast one). V3.2's Triton half (its sparse attention
# as one-token pages of the MLA decode kernel, its indexer's scores) is its kernels' tests and
# test_current_families' decode: in the interpreter its every query is a decode row (~40 s).
CASES = [(shape, impl) for shape in sorted(SHAPES) for impl in ("ref", "triton")
         if not (impl == "triton" and shape.startswith("v32"))]


@pytest.fixture(scope="module", params=[pytest.param(c, marks=[pytest.mark.slow] if c[1] == "triton" else [],
                                                     id=f"{c[1]}-{c[0]}") for c in CASES])
def pair(request, tmp_path_factory):
    shape, impl = request.param
    ckpt = tmp_path_factory.mktemp(shape)
    hf = make_hf_checkpoint(shape, ckpt)
    model = load_model(ckpt, impl=impl)
    assert model.impl == impl and all(m.impl == impl for m in model.moe_layers())
    return hf, model


def _prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["naive", "absorbed"])
def test_prefill_logits_match_transformers(pair, attn):
    hf, ours = pair
    ids = _prompt(150, ours.cfg.vocab_size)  # longer than YaRN's original context (64)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    pool = ours.new_pool(10, 16)
    got = ours.prefill(ids, pool, torch.arange(10), attn=attn, all_logits=True)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_32_greedy_tokens_identical_to_generate(pair):
    hf, ours = pair
    ids = _prompt(20, ours.cfg.vocab_size, seed=2)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, 20:].tolist()
    assert len(ref) == 32
    assert generate(ours, ids.tolist(), 32, eos_id=None) == ref
