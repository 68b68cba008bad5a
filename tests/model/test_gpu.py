"""The model on a GPU: weights and the latent pool in device memory, the Triton kernels selected by
``impl="auto"``, and the same answers as transformers on the CPU (fp32). Skipped without CUDA
(CI has none); a GPU session runs them through scripts/gpu-check.sh."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model
from model.generate import generate
from tests.model.hf_checkpoints import SHAPES, make_hf_checkpoint

transformers = pytest.importorskip("transformers")


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="'cuda': CUDA is not available"):
        load_model(tmp_path, device="cuda")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, ckpt)
    model = load_model(ckpt, device="cuda")
    return hf, model


@pytest.mark.gpu
def test_auto_selects_triton_and_keeps_everything_on_the_device(pair):
    _, model = pair
    assert model.impl == "triton" and all(m.impl == "triton" for m in model.moe_layers())
    assert model.device.type == "cuda" and model.new_pool(4, 16).data.is_cuda


@pytest.mark.gpu
def test_prefill_and_decode_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [T, V] on the CPU
    pool = ours.new_pool(10, 16)
    table = torch.arange(10)
    got = ours.prefill(ids[:140], pool, table, all_logits=True)  # CPU inputs are moved to the GPU
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), ref[:140], atol=1e-3, rtol=0)
    for pos in range(140, 150):  # decode over the paged pool with the Triton MLA kernel
        step = ours.decode(ids[pos : pos + 1], pool, table[None], torch.tensor([pos]))
        torch.testing.assert_close(step[0].cpu(), ref[pos], atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_greedy_tokens_identical_to_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, 20:].tolist()
    assert generate(ours, ids.tolist(), 32, eos_id=None) == ref


@pytest.mark.gpu
def test_unit_pages_round_trip_through_host_memory(pair):
    _, model = pair
    pool = model.new_pool(8, 16)
    pool.data.normal_()
    pages = [5, 2, 7, 0]  # one 64-token unit
    host = pool.read_pages(pages).cpu()  # what persisting a unit copies out
    other = model.new_pool(8, 16)
    other.write_pages([1, 3, 4, 6], host)  # what loading it copies in
    torch.testing.assert_close(other.read_pages([1, 3, 4, 6]).cpu(), host, atol=0, rtol=0)


def test_warmup_leaves_no_state_behind(tmp_path):
    """What a GPU replica runs before serving (to compile and tune the kernels), here on the CPU."""
    make_hf_checkpoint("v3_grouped_yarn", tmp_path)
    model = load_model(tmp_path)
    before = generate(model, [1, 2, 3, 4], 8, eos_id=None)
    model.warmup(prefill_tokens=40, decode_batch=3)
    assert generate(model, [1, 2, 3, 4], 8, eos_id=None) == before


@pytest.mark.gpu
def test_an_fp8_checkpoint_keeps_its_weights_in_fp8_on_cuda_within_fp8s_error(tmp_path):
    """On CUDA an fp8 checkpoint's projections and experts stay e4m3 (``fp8_weights="auto"``)
    and run the block-scaled fp8 GEMMs on the tensor cores; the logits stay within fp8's error
    of the same checkpoint dequantized to bfloat16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from model.quant import Fp8Weight
    from tests.model.test_fp8 import make_fp8_checkpoint

    src, out = tmp_path / "src", tmp_path / "fp8"
    make_hf_checkpoint("v3_grouped_yarn", src)
    make_fp8_checkpoint(src, out, (16, 32))
    kept = load_model(out, "bfloat16", device="cuda")
    dense = load_model(out, "bfloat16", device="cuda", fp8_weights="dequantize")
    assert isinstance(kept.layers[0].attn.w.o, Fp8Weight) and kept.layers[0].attn.w.o.q.is_cuda
    ids = torch.randint(0, kept.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    a = kept.prefill(ids, kept.new_pool(8, 16), torch.arange(8), all_logits=True).float()
    b = dense.prefill(ids, dense.new_pool(8, 16), torch.arange(8), all_logits=True).float()
    assert (a - b).norm() <= 0.3 * b.norm(), float((a - b).norm() / b.norm())
