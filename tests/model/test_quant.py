"""int8 CPU weights (model.quant): the kernels compute exactly what the dequantized weights do,
the model holds under a third of the bytes, and bad requests are refused by name."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import named_config
from model.quant import Q8Weight, weight_bytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = named_config("tiny")
    return save_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_state_dict(cfg, seed=5, std=0.06))


def _dequantized(q8, fp32) -> None:
    """Give ``fp32`` exactly the weights ``q8`` holds (dequantized)."""
    fp32.lm_head = q8.lm_head.dequantize()
    for lq, lf in zip(q8.layers, fp32.layers, strict=True):
        for name in ("q", "q_a", "q_b", "kv_a", "o"):
            if isinstance(w := getattr(lq.attn.w, name), Q8Weight):
                setattr(lf.attn.w, name, w.dequantize())
        mq, mf = (getattr(lq.mlp, "shared", lq.mlp), getattr(lf.mlp, "shared", lf.mlp))
        if mq is not None:
            mf.gate_up, mf.down = mq.gate_up.dequantize(), mq.down.dequantize()
    experts_q, experts_f = q8.moe_layers()[0].executor.layers, fp32.moe_layers()[0].executor.layers
    for layer, w in experts_q.items():
        experts_f[layer].gate_up, experts_f[layer].down = w.gate_up.dequantize(), w.down.dequantize()


def test_int8_weights_compute_what_their_dequantized_weights_do(checkpoint):
    """Prefill (int8 dequantized per call) and decode (the int8 kernels) against an fp32 model
    holding the same dequantized weights; every projection and expert is held as int8."""
    q8, ref = load_model(checkpoint, cpu_weights="int8"), load_model(checkpoint)
    _dequantized(q8, ref)
    assert isinstance(q8.lm_head, Q8Weight) and isinstance(q8.layers[-1].attn.w.o, Q8Weight)
    ids = torch.randint(0, q8.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))

    def run(m):
        pool, tables = m.new_pool(16), torch.arange(16).view(2, 8)
        first = torch.stack([m.prefill(ids[: 30 + i], pool, tables[i]) for i in range(2)])
        step = m.decode(torch.tensor([3, 4]), pool, tables, torch.tensor([30, 31]))  # two decode rows
        return torch.cat([first, step])

    torch.testing.assert_close(run(q8), run(ref), atol=1e-5, rtol=1e-5)


def test_int8_weights_hold_under_a_third_of_the_bytes(checkpoint):
    fp32, q8 = weight_bytes(load_model(checkpoint)), weight_bytes(load_model(checkpoint, cpu_weights="int8"))
    assert q8 < fp32 / 3, (q8, fp32)


def test_bad_cpu_weights_are_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match="'int4'.*fp32, int8"):
        load_model(checkpoint, cpu_weights="int4")
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        load_model(checkpoint, "bfloat16", cpu_weights="int8")


def test_int8_weights_cache_their_kv_in_a_namespace_of_their_own(checkpoint):
    from cluster.request import cache_namespace
    from model.config import load_config
    from model.weights_id import weights_digest

    cfg, digest = load_config(checkpoint), weights_digest(checkpoint)
    fp32 = cache_namespace(cfg, digest, torch.float32)
    int8 = cache_namespace(cfg, digest, torch.float32, weights="int8")
    assert fp32.seed != int8.seed and fp32 == cache_namespace(cfg, digest, torch.float32, weights="fp32")


def test_fp8_weights_stack_index_and_fuse_by_whole_scale_blocks():
    """What expert shards and the fused gate/up projection do with fp8 weights: stack experts,
    take one back out (moving experts between shards), and concatenate rows only where the
    first part ends on a scale block."""
    from kernels.fp8_gemm import quantize_blocks
    from model.quant import Fp8Weight

    ws = [torch.randn(32, 48, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    parts = [Fp8Weight(*quantize_blocks(w, (16, 32)), (16, 32)) for w in ws]
    stacked = Fp8Weight.stack(parts)
    assert stacked.shape == (3, 32, 48) and stacked.scale.shape == (3, 2, 2)
    assert torch.equal(stacked[1].dequantize(), parts[1].dequantize())
    assert torch.equal(stacked[2].to("cpu", copy=True).q.float(), parts[2].q.float())
    fused = Fp8Weight.cat_rows(parts[:2])
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts[:2]]))
    ragged = Fp8Weight(*quantize_blocks(ws[0][:20], (16, 32)), (16, 32))  # 20 rows: ends inside a block
    assert Fp8Weight.cat_rows([ragged, parts[1]]) is None and Fp8Weight.cat_rows([parts[1], ragged]) is not None
    assert parts[0].nbytes == 32 * 48 + 2 * 2 * 4
