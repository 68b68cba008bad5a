"""FP8 checkpoints as DeepSeek publishes V3/R1 (e4m3 weights with a ``weight_scale_inv`` per
block, ``quantization_config``, a sharded index): loaded by dequantizing once, they give
transformers' logits on the dequantized weights; kept in fp8 (the fp8 GEMMs), they stay within
fp8's error of them."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.checkpoint import CheckpointError, dequantize_fp8, load_model
from model.generate import generate
from tests.model.hf_checkpoints import make_hf_checkpoint

transformers = pytest.importorskip("transformers")

QUANTIZED = re.compile(r"proj\.weight$")  # what DeepSeek keeps in fp8: every projection, routed experts too
E4M3_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: per block, scale = amax / 448 and q = w / scale in e4m3."""
    n, k = w.shape
    bn, bk = block
    scales = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s = max(float(tile.abs().max()), 1e-12) / E4M3_MAX
            scales[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / s).to(torch.float8_e4m3fn)
    return q, scales


def make_fp8_checkpoint(src, out, block: tuple[int, int], quantized: re.Pattern = QUANTIZED) -> dict[str, torch.Tensor]:
    """``src``'s weights quantized into ``out`` as two shards with an index; returns the
    dequantized state dict (what the fp8 checkpoint stands for)."""
    with safe_open(src / "model.safetensors", "pt") as f:
        sd = {name: f.get_tensor(name) for name in f.keys()}
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    dequantized = {}
    for i, (name, t) in enumerate(sorted(sd.items())):
        if quantized.search(name) and t.dim() == 2:
            q, s = quantize_fp8(t, block)
            shards[i % 2][name] = q
            shards[(i + i // 2) % 2][name + "_scale_inv"] = s  # the scales in the same shard or the other
            dequantized[name] = dequantize_fp8(q, s, block)
        else:
            shards[i % 2][name] = t
            dequantized[name] = t
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.fixture(scope="module", params=[(128, 128), (16, 32)], ids=["blocks_128x128", "blocks_16x32"])
def fp8(request, tmp_path_factory):
    src, out, ref = (tmp_path_factory.mktemp(n) for n in ("fp32", "fp8", "dequantized"))
    make_hf_checkpoint("v3_grouped_yarn", src)
    dequantized = make_fp8_checkpoint(src, out, request.param)
    # transformers runs the weights the fp8 checkpoint stands for, read as it reads any checkpoint
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    (ref / "config.json").write_text((src / "config.json").read_text())
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(ref, torch_dtype=torch.float32).eval()
    return hf, out


def test_an_fp8_checkpoint_gives_transformers_logits_on_its_dequantized_weights(fp8):
    hf, ckpt = fp8
    ours = load_model(ckpt)
    ids = torch.randint(0, ours.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.prefill(ids, ours.new_pool(8, 16), torch.arange(8), all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        want = hf.generate(ids[None, :20], max_new_tokens=16, do_sample=False)[0, 20:].tolist()
    assert generate(ours, ids[:20].tolist(), 16, eos_id=None) == want


def test_an_fp8_checkpoint_held_in_int8_on_the_cpu_gives_transformers_logits_on_those_weights(tmp_path):
    """cpu_weights="int8" re-quantizes the dequantized FP8 weights (every projection but kv_b,
    the experts, the LM head) to int8 per row and 128 columns: the logits are transformers' on
    exactly the weights the int8 model holds, and so are the greedy tokens."""
    from kernels.cpu_gemv import dequantize_q8, quantize_q8

    src, out, ref = tmp_path / "fp32", tmp_path / "fp8", tmp_path / "int8-equivalent"
    make_hf_checkpoint("v3_grouped_yarn", src)
    weights = make_fp8_checkpoint(src, out, (128, 128))
    int8 = re.compile(r"(proj|proj_with_mqa)\.weight$|^lm_head\.weight$")
    held = {name: dequantize_q8(*quantize_q8(t)) if int8.search(name) and "kv_b_proj" not in name else t
            for name, t in weights.items()}
    ref.mkdir()
    save_file(held, str(ref / "model.safetensors"), metadata={"format": "pt"})
    (ref / "config.json").write_text((src / "config.json").read_text())
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(ref, torch_dtype=torch.float32).eval()
    ours = load_model(out, cpu_weights="int8")
    ids = torch.randint(0, ours.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = ours.prefill(ids, ours.new_pool(8, 16), torch.arange(8), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        tokens = hf.generate(ids[None, :20], max_new_tokens=16, do_sample=False)[0, 20:].tolist()
    assert generate(ours, ids[:20].tolist(), 16, eos_id=None) == tokens  # decode: the int8 kernels


def test_fp8_weights_without_an_fp8_config_or_their_scales_are_refused(tmp_path):
    src = tmp_path / "fp32"
    make_hf_checkpoint("v3_ungrouped", src)
    out = tmp_path / "fp8"
    make_fp8_checkpoint(src, out, (128, 128))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match="quantization_config"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="'awq' is not supported"):
        load_model(out)
    with pytest.raises(CheckpointError, match="2x2 blocks need|blocks need"):
        dequantize_fp8(torch.zeros(200, 100, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))


class _Shards:
    """Expert shards in this process, each loading its slots' experts from the checkpoint as an
    ``ExpertShard`` does (``load_expert_slots``); rows travel by slicing."""

    def __init__(self, ckpt, placement, moe_layers: list[int], wire, keep_fp8: bool = False) -> None:
        from cluster.ep import ShardExperts
        from model.checkpoint import load_expert_slots

        per = placement.slots_per_shard
        self.wire, self.shards = wire, []
        for h in range(placement.num_shards):
            slots = {layer: placement.phy2log[row, h * per : (h + 1) * per].tolist()
                     for row, layer in enumerate(moe_layers)}
            loaded = load_expert_slots(ckpt, slots, keep_fp8=keep_fp8)
            shard = ShardExperts()
            shard.put(0, {row: loaded[layer] for row, layer in enumerate(moe_layers)})
            self.shards.append(shard)

    def dispatch_combine(self, layer, version, rnd):
        from cluster.ep import shard_round

        return torch.cat([shard_round(s.compute, self.wire, torch.float32, version, layer, rnd.part(h))
                          for h, s in enumerate(self.shards)])


@pytest.mark.parametrize("fp8", [(128, 128)], indirect=True, ids=["blocks_128x128"])
def test_an_fp8_checkpoint_over_expert_shards_gives_transformers_logits(fp8):
    """The expert-parallel path: an attention model without its routed experts and three shards
    that load theirs from the FP8 checkpoint (dequantized as the dense weights are) give
    transformers' logits with the model's dtype on the wire, and stay within FP8 dispatch's
    tolerance with DeepSeek's wire (FP8 dispatch, BF16 combine)."""
    from cluster.ep import EPExecutor, Wire
    from cluster.eplb import EplbConfig, plan

    hf, ckpt = fp8
    ours = load_model(ckpt, routed_experts=False)
    cfg = ours.cfg
    moe_layers = [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace]
    slots = cfg.n_routed_experts + (-cfg.n_routed_experts) % 3 + 3
    placement = plan(torch.ones(len(moe_layers), cfg.n_routed_experts, dtype=torch.float64),
                     EplbConfig(slots, 1, 1, 3, "global"))
    ids = torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for wire in (Wire(), Wire("fp8", "bf16")):
        ours.set_expert_executor(EPExecutor(placement, moe_layers, _Shards(ckpt, placement, moe_layers, wire),
                                            wire=wire))
        got = ours.prefill(ids, ours.new_pool(8, 16), torch.arange(8), all_logits=True)
        if wire.dispatch == "native":
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        else:
            assert (got - ref).norm() <= 0.12 * ref.norm(), float((got - ref).norm() / ref.norm())


@pytest.mark.slow  # the fp8 GEMMs in Triton's interpreter
def test_fp8_weights_kept_as_stored_stay_within_fp8s_error_of_transformers(fp8):
    """fp8_weights="keep" (CUDA's default; here under Triton's interpreter): the projections and
    experts stay e4m3 with the checkpoint's scales and run the block-scaled fp8 GEMMs with
    activations quantized per token and block. The logits stay within fp8's error of
    transformers on the dequantized weights (this model's random gates score experts alike, so
    that error flips some of its routing), and the greedy tokens equal its own up to a step
    where its top-two margin is within that error."""
    from model.quant import Fp8Weight, weight_bytes

    hf, ckpt = fp8
    ours = load_model(ckpt, fp8_weights="keep")
    w = ours.layers[0].attn.w
    assert isinstance(w.q_a, Fp8Weight) and isinstance(w.o, Fp8Weight) and not isinstance(w.kv_b, Fp8Weight)
    # experts stay fp8 where gate's rows end on a scale block (gate and up are fused), else dense
    fp8_experts = ours.cfg.moe_intermediate_size % json.loads((ckpt / "config.json").read_text())[
        "quantization_config"]["weight_block_size"][0] == 0
    experts = next(m.executor for m in ours.moe_layers()).layers
    assert all(isinstance(e.gate_up, Fp8Weight) == isinstance(e.down, Fp8Weight) == fp8_experts
               for e in experts.values())
    assert weight_bytes(ours) < weight_bytes(load_model(ckpt)) and w.o.nbytes < w.o.dequantize().nbytes / 3
    ids = torch.randint(0, ours.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.prefill(ids, ours.new_pool(8, 16), torch.arange(8), all_logits=True)
    err = float((got - ref).abs().max())
    assert 0 < err and (got - ref).norm() <= 0.3 * ref.norm(), float((got - ref).norm() / ref.norm())
    if not fp8_experts:
        return  # greedy decoding is compared where the experts are fp8 too (16x32 blocks)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    rms = float((got - ref).pow(2).mean().sqrt())
    compared = 0
    for prompt in (ids[:20], ids[20:40]):
        with torch.no_grad():
            out = hf.generate(prompt[None], max_new_tokens=4, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        sure = next((i for i, m in enumerate(margins) if m <= 2 * rms), len(want))  # up to a near tie
        assert generate(ours, prompt.tolist(), 4, eos_id=None)[:sure] == want[:sure]  # decode: the fp8 GEMMs too
        compared += sure
    assert compared >= 3, "too few steps with a margin above fp8's error to compare: choose other prompts"


def test_fp8_weights_kept_off_cuda_need_the_interpreter(fp8, monkeypatch):
    _, ckpt = fp8
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA"):
        load_model(ckpt, fp8_weights="keep")
    with pytest.raises(ValueError, match="unsupported fp8_weights 'bf16'"):
        load_model(ckpt, fp8_weights="bf16")
    assert isinstance(load_model(ckpt).layers[0].attn.w.o, torch.Tensor)  # auto on a CPU: dequantized


@pytest.mark.slow  # the fp8 GEMMs in Triton's interpreter
@pytest.mark.parametrize("fp8", [(16, 32)], indirect=True, ids=["blocks_16x32"])
def test_fp8_experts_kept_on_expert_shards_compute_what_the_local_fp8_model_does(fp8):
    """The expert-parallel path with fp8 kept (a CUDA shard's default): three shards load their
    slots' experts as e4m3 and run the fp8 grouped GEMM; the logits equal the local fp8 model's
    (each token's rows are quantized alone, wherever they run) and so stay within its error of
    transformers."""
    from cluster.ep import EPExecutor, Wire
    from cluster.eplb import EplbConfig, plan
    from model.quant import Fp8Weight

    hf, ckpt = fp8
    local = load_model(ckpt, fp8_weights="keep")
    ours = load_model(ckpt, routed_experts=False, fp8_weights="keep")
    cfg = ours.cfg
    moe_layers = [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace]
    placement = plan(torch.ones(len(moe_layers), cfg.n_routed_experts, dtype=torch.float64),
                     EplbConfig(cfg.n_routed_experts + 2, 1, 1, 2, "global"))
    shards = _Shards(ckpt, placement, moe_layers, Wire(), keep_fp8=True)
    assert all(isinstance(s.layer(0, 0).gate_up, Fp8Weight) for s in shards.shards)
    ours.set_expert_executor(EPExecutor(placement, moe_layers, shards, wire=Wire()))
    ids = torch.randint(0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(2))
    got = ours.prefill(ids, ours.new_pool(4, 16), torch.arange(4), all_logits=True)
    want = local.prefill(ids, local.new_pool(4, 16), torch.arange(4), all_logits=True)
    assert (got - want).norm() <= 1e-4 * want.norm(), float((got - want).norm() / want.norm())
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (got - ref).norm() <= 0.3 * ref.norm()


def test_fp8_weights_kept_compute_in_a_cache_namespace_of_their_own(fp8):
    """A replica that keeps fp8 weights computes other KV than one that dequantized them: their
    units live apart (the ingress and the replica both name the form from the same config)."""
    from cluster.request import cache_namespace
    from model.config import load_config
    from model.weights_id import weights_digest, weights_form

    _, ckpt = fp8
    assert weights_form(ckpt, "cuda") == "fp8" and weights_form(ckpt, "cpu") == "fp32"
    assert weights_form(ckpt, "cuda", fp8_weights="dequantize") == "fp32"
    assert weights_form(ckpt, "cpu", fp8_weights="keep") == "fp8"  # under the interpreter
    cfg, digest = load_config(ckpt), weights_digest(ckpt)
    kept, dense = (cache_namespace(cfg, digest, torch.bfloat16, weights=weights_form(ckpt, "cuda", fp8_weights=f))
                   for f in ("auto", "dequantize"))
    assert kept.seed != dense.seed


def test_a_v32_fp8_checkpoint_with_its_indexer_in_fp8_gives_transformers_logits(tmp_path):
    """DeepSeek-V3.2 as published: the indexer's query and key projections in e4m3 too (its head
    weights not); dequantized at load, the logits are transformers' on those weights."""
    src, out, ref = tmp_path / "fp32", tmp_path / "fp8", tmp_path / "dequantized"
    make_hf_checkpoint("v32_sparse_yarn", src)
    dequantized = make_fp8_checkpoint(src, out, (16, 16), re.compile(r"((?<!weights_)proj|indexer\.wq_b|indexer\.wk)\.weight$"))
    stored = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.endswith("indexer.wk.weight_scale_inv") for n in stored)
    assert not any(n.endswith("weights_proj.weight_scale_inv") for n in stored)
    ref.mkdir()
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    (ref / "config.json").write_text((src / "config.json").read_text())
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(ref, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 160, (90,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    ours = load_model(out)
    torch.testing.assert_close(ours.prefill(ids, ours.new_pool(8, 16), torch.arange(8), all_logits=True), want,
                               atol=1e-4, rtol=0)
