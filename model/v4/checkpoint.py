"""DeepSeek-V4 checkpoints as published on the Hub: expected tensors, loading, building, random init.

Tensor names are the Hub's (``embed.weight``, ``layers.0.attn.wq_a.weight``,
``layers.0.ffn.experts.0.w1.weight``, ``hc_head_fn`` ...); the names ``transformers`` writes
(``model.`` in front, ``embed_tokens``, ``hc_head.hc_fn``) are read as those. Quantized tensors
carry a ``<name>.scale`` grid: e4m3 weights (fp8) and int8 bytes holding two e2m1 values each
(fp4, the routed experts); both are dequantized once at load. The multi-token-prediction layer
(``mtp.*``) is not read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import resolve_impl
from model.config import WEIGHTS_FILE, WEIGHTS_INDEX
from model.layers import SwiGLU
from model.moe import ExpertWeights, LocalExpertExecutor
from model.v4.attention import Attention, AttentionWeights, CompressorWeights, IndexerWeights
from model.v4.config import CSA, HCA, V4Config
from model.v4.layers import HyperConnection, HyperHead, Rope
from model.v4.model import DeepseekV4Model, V4Layer
from model.v4.moe import V4Gate, V4MoE
from model.weights_id import CheckpointError

__all__ = ["build_v4", "canonical_name", "expected_shapes", "load_v4", "load_v4_state_dict",
           "random_v4_state_dict"]

SCALE = ".scale"
_RENAMES = [(re.compile(r"^model\."), ""), (re.compile(r"^embed_tokens\."), "embed."),
            (re.compile(r"^hc_head\.hc_"), "hc_head_"), (re.compile(r"^lm_head\."), "head.")]
# kept in fp32 whatever the model's dtype, as DeepSeek's reference keeps them
_FP32 = re.compile(r"(hc_|attn_sink|\.ape$|norm\.weight$|ffn\.gate\.(weight|bias)$)")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def canonical_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def expected_shapes(cfg: V4Config) -> dict[str, tuple[int, ...]]:
    """Hub tensor name -> shape, for every tensor the architecture needs."""
    m, h, d, q, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    mix = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, m), "norm.weight": (m,),
        "hc_head_fn": (n, n * m), "hc_head_base": (n,), "hc_head_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, m)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (m,), p + "ffn_norm.weight": (m,)}
        for block in ("attn", "ffn"):
            shapes |= {f"{p}hc_{block}_fn": (mix, n * m), f"{p}hc_{block}_base": (mix,), f"{p}hc_{block}_scale": (3,)}
        a = p + "attn."
        shapes |= {a + "wq_a.weight": (q, m), a + "q_norm.weight": (q,), a + "wq_b.weight": (h * d, q),
                   a + "wkv.weight": (d, m), a + "norm.weight": (d,), a + "attn_sink": (h,),
                   a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * d // cfg.o_groups),
                   a + "wo_b.weight": (m, cfg.o_groups * cfg.o_lora_rank)}
        kind = cfg.layer_types[i]
        if kind in (CSA, HCA):
            c = 2 if kind == CSA else 1
            _compressor(shapes, a + "compressor.", c * d, d, cfg.ratio(i), m)
        if kind == CSA:
            g, di = cfg.index_n_heads, cfg.index_head_dim
            shapes |= {a + "indexer.wq_b.weight": (g * di, q), a + "indexer.weights_proj.weight": (g, m)}
            _compressor(shapes, a + "indexer.compressor.", 2 * di, di, cfg.ratio(i), m)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (cfg.n_routed_experts, m)
        if cfg.mlp_layer_types[i] == "hash_moe":
            shapes[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            shapes[f + "gate.bias"] = (cfg.n_routed_experts,)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            _mlp(shapes, f"{f}experts.{e}.", m, inter)
        if cfg.n_shared_experts:
            _mlp(shapes, f + "shared_experts.", m, inter * cfg.n_shared_experts)
    return shapes


def _compressor(shapes: dict, prefix: str, out: int, dim: int, ratio: int, m: int) -> None:
    shapes |= {prefix + "wkv.weight": (out, m), prefix + "wgate.weight": (out, m), prefix + "ape": (ratio, out),
               prefix + "norm.weight": (dim,)}


def _mlp(shapes: dict, prefix: str, m: int, inter: int) -> None:
    shapes |= {prefix + "w1.weight": (inter, m), prefix + "w3.weight": (inter, m), prefix + "w2.weight": (m, inter)}


def _files(ckpt: Path) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name -> (file, name as stored)."""
    index = ckpt / WEIGHTS_INDEX
    if index.is_file():
        stored = {name: ckpt / fname for name, fname in json.loads(index.read_text())["weight_map"].items()}
    elif (ckpt / WEIGHTS_FILE).is_file():
        with safe_open(ckpt / WEIGHTS_FILE, "pt") as f:
            stored = {name: ckpt / WEIGHTS_FILE for name in f.keys()}
    else:
        raise CheckpointError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {ckpt}")
    return {canonical_name(name): (path, name) for name, path in stored.items() if not name.startswith("mtp.")}


def dequantize(q: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """An e4m3 weight [N, K], or int8 bytes [N, K/2] of e2m1 pairs (low nibble first), times its
    scale grid [N/bn, K/bk] (e8m0, or any float) -> float32 [N, K]."""
    if q.dtype == torch.int8 or q.dtype == torch.uint8:
        u8 = q.view(torch.uint8)
        lut = torch.tensor(_FP4_VALUES)
        values = torch.stack((lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]), dim=-1).flatten(-2)
    else:
        values = q.float()
    s = scale.float() if scale.dtype != torch.uint8 else torch.exp2(scale.float() - 127)
    rows, cols = values.shape
    if s.dim() != 2 or rows % s.shape[0] or cols % s.shape[1]:
        raise CheckpointError(f"tensor {name!r}: scales of shape {tuple(s.shape)} do not tile a [{rows}, {cols}] weight")
    bn, bk = rows // s.shape[0], cols // s.shape[1]
    return (values.view(s.shape[0], bn, s.shape[1], bk) * s[:, None, :, None]).view(rows, cols)


def load_v4_state_dict(ckpt_dir: str | Path, cfg: V4Config, dtype: torch.dtype = torch.float32,
                       include: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor the architecture needs (or those ``include`` accepts), validated and in
    ``dtype`` (the fp32 ones kept; ``tid2eid`` stays integer); nothing may be left over."""
    ckpt = Path(ckpt_dir)
    want, where = expected_shapes(cfg), _files(ckpt)
    extra = [n for n in where if n not in want and not (n.endswith(SCALE) and n[: -len(SCALE)] + ".weight" in want)]
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    missing = [n for n in want if n not in where]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} in all)")
    out = {}
    for name, shape in want.items():
        if include is not None and not include(name):
            continue
        path, stored = where[name]
        with safe_open(path, "pt") as f:
            t = f.get_tensor(stored)
        scale_name = name[: -len(".weight")] + SCALE if name.endswith(".weight") else None
        if scale_name in where:
            spath, sstored = where[scale_name]
            with safe_open(spath, "pt") as f:
                t = dequantize(t, f.get_tensor(sstored), name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config needs {shape}")
        if name.endswith("tid2eid"):
            out[name] = t.long()
        elif not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has non-float dtype {t.dtype} and no {SCALE!r} grid")
        else:
            out[name] = t.to(torch.float32 if _FP32.search(name) else dtype)
    return out


def build_v4(cfg: V4Config, sd: dict[str, torch.Tensor], impl: str = "auto") -> DeepseekV4Model:
    """Assemble a model from a validated Hub-named state dict. Without routed-expert tensors the
    model gets no expert executor: the caller sets one (expert parallelism)."""
    kernels_impl = resolve_impl(impl, sd["embed.weight"].device)
    ropes = {"main": Rope(cfg, "main"), "compress": Rope(cfg, "compress")}
    layers, experts = [], {}
    for i in range(cfg.num_hidden_layers):
        p, a, f = f"layers.{i}.", f"layers.{i}.attn.", f"layers.{i}.ffn."
        kind = cfg.layer_types[i]
        w = AttentionWeights(sd[a + "wq_a.weight"], sd[a + "q_norm.weight"], sd[a + "wq_b.weight"],
                             sd[a + "wkv.weight"], sd[a + "norm.weight"], sd[a + "wo_a.weight"], sd[a + "wo_b.weight"],
                             sd[a + "attn_sink"])
        if kind != "sliding_attention":
            w.compressor = _compressor_weights(sd, a + "compressor.")
        if kind == CSA:
            w.indexer = IndexerWeights(sd[a + "indexer.wq_b.weight"], sd[a + "indexer.weights_proj.weight"],
                                       _compressor_weights(sd, a + "indexer.compressor."))
        attn = Attention(cfg, i, w, ropes["main" if kind == "sliding_attention" else "compress"], kernels_impl)
        gate = V4Gate(sd[f + "gate.weight"], sd.get(f + "gate.bias"), sd.get(f + "gate.tid2eid"))
        shared = None
        if cfg.n_shared_experts:
            s = f + "shared_experts."
            shared = SwiGLU(torch.cat((sd[s + "w1.weight"], sd[s + "w3.weight"])), sd[s + "w2.weight"], cfg.swiglu_limit)
        if f + "experts.0.w1.weight" in sd:
            experts[i] = ExpertWeights.stack(
                [torch.cat((sd[f"{f}experts.{e}.w1.weight"], sd[f"{f}experts.{e}.w3.weight"]))
                 for e in range(cfg.n_routed_experts)],
                [sd[f"{f}experts.{e}.w2.weight"] for e in range(cfg.n_routed_experts)], cfg.swiglu_limit)
        layers.append(V4Layer(sd[p + "attn_norm.weight"], attn, sd[p + "ffn_norm.weight"],
                              V4MoE(cfg, i, gate, shared, kernels_impl), _hc(sd, p + "hc_attn_"), _hc(sd, p + "hc_ffn_")))
    embed = sd["embed.weight"]
    head = embed if cfg.tie_word_embeddings else sd["head.weight"]
    hc_head = HyperHead(sd["hc_head_fn"], sd["hc_head_base"], sd["hc_head_scale"])
    model = DeepseekV4Model(cfg, embed, layers, sd["norm.weight"], head, hc_head, ropes, kernels_impl)
    if experts:
        model.set_expert_executor(LocalExpertExecutor(experts, kernels_impl))
    return model


def _compressor_weights(sd: dict[str, torch.Tensor], prefix: str) -> CompressorWeights:
    return CompressorWeights(sd[prefix + "wkv.weight"], sd[prefix + "wgate.weight"], sd[prefix + "ape"],
                             sd[prefix + "norm.weight"])


def _hc(sd: dict[str, torch.Tensor], prefix: str) -> HyperConnection:
    return HyperConnection(sd[prefix + "fn"], sd[prefix + "base"], sd[prefix + "scale"])


def load_v4(ckpt_dir: str | Path, cfg: V4Config, dtype: torch.dtype, impl: str = "auto", routed_experts: bool = True,
            device: torch.device = torch.device("cpu")) -> DeepseekV4Model:
    """``routed_experts=False`` leaves the routed experts on disk (expert parallelism)."""
    include = None if routed_experts else (lambda name: ".ffn.experts." not in name)
    sd = load_v4_state_dict(ckpt_dir, cfg, dtype, include)
    for name in sd:
        sd[name] = sd[name].to(device)
    return build_v4(cfg, sd, impl)


def random_v4_state_dict(cfg: V4Config, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Deterministic random weights (norms and scales at 1, biases and sinks at 0, hash tables
    spread over the experts)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("tid2eid"):
            sd[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=gen)
        elif name.endswith(("norm.weight", "_scale")):
            sd[name] = torch.ones(shape)
        elif name.endswith(("gate.bias", "attn_sink", "_base", ".ape")):
            sd[name] = torch.zeros(shape)
        else:
            sd[name] = torch.randn(shape, generator=gen) * std
    return sd
