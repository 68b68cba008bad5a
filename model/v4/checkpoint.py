"""DeepSeek-V4 checkpoints as published on the Hub: expected tensors, loading, building, random init.

Tensor names are the Hub's (``embed.weight``, ``layers.0.attn.wq_a.weight``,
``layers.0.ffn.experts.0.w1.weight``, ``hc_head_fn`` ...); the names ``transformers`` writes
(``model.`` in front, ``embed_tokens``, ``hc_head.hc_fn``, an attention's ``norm`` for the Hub's
``kv_norm``) are read as those. Quantized tensors carry a ``<name>.scale`` grid: e4m3 weights
(fp8) and int8 bytes holding two e2m1 values each (fp4, the routed experts); both are dequantized
once at load. The multi-token-prediction layers (``mtp.{k}.``: a sliding-window, top-k routed
block and its input projections, ``model.v4.mtp``) are read when asked for.
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
from model.v4.config import CSA, HCA, SLIDING, V4Config
from model.v4.layers import HyperConnection, HyperHead, Rope
from model.v4.model import DeepseekV4Model, V4Layer
from model.v4.moe import V4Gate, V4MoE
from model.v4.mtp import V4MtpLayer
from model.weights_id import CheckpointError, stored_mtp_layers

__all__ = ["build_v4", "canonical_name", "expected_shapes", "layer_prefix", "load_v4", "load_v4_state_dict",
           "random_v4_state_dict"]

SCALE = ".scale"
_RENAMES = [(re.compile(r"^model\."), ""), (re.compile(r"^embed_tokens\."), "embed."),
            (re.compile(r"^hc_head\.hc_"), "hc_head_"), (re.compile(r"^lm_head\."), "head."),
            (re.compile(r"\.attn\.norm\.weight$"), ".attn.kv_norm.weight")]
# kept in fp32 whatever the model's dtype, as DeepSeek's reference keeps them
_FP32 = re.compile(r"(hc_|attn_sink|\.ape$|norm\.weight$|ffn\.gate\.(weight|bias)$)")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def canonical_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def layer_prefix(cfg: V4Config, layer: int) -> str:
    """The Hub name prefix of model layer ``layer``: ``layers.{i}.``, or after the model's layers
    an MTP layer's ``mtp.{k}.``."""
    n = cfg.num_hidden_layers
    return f"layers.{layer}." if layer < n else f"mtp.{layer - n}."


def expected_shapes(cfg: V4Config, mtp_layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Hub tensor name -> shape, for every tensor the architecture needs, with those of its first
    ``mtp_layers`` MTP layers (default: all it declares)."""
    m, n = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, m), "norm.weight": (m,),
        "hc_head_fn": (n, n * m), "hc_head_base": (n,), "hc_head_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, m)
    for i in range(cfg.num_hidden_layers):
        _block(shapes, cfg, f"layers.{i}.", cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.ratio(i))
    for k in range(cfg.num_nextn_predict_layers if mtp_layers is None else mtp_layers):
        p = f"mtp.{k}."  # a sliding-window block routed by its gate, its input projections, its head's collapse
        _block(shapes, cfg, p, SLIDING, "moe", 0)
        shapes |= {p + "e_proj.weight": (m, m), p + "h_proj.weight": (m, m), p + "enorm.weight": (m,),
                   p + "hnorm.weight": (m,), p + "norm.weight": (m,), p + "hc_head_fn": (n, n * m),
                   p + "hc_head_base": (n,), p + "hc_head_scale": (1,)}
    return shapes


def _block(shapes: dict, cfg: V4Config, p: str, kind: str, mlp_kind: str, ratio: int) -> None:
    """A decoder block's tensors under prefix ``p``."""
    m, h, d, q, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    mix = (2 + n) * n
    shapes |= {p + "attn_norm.weight": (m,), p + "ffn_norm.weight": (m,)}
    for block in ("attn", "ffn"):
        shapes |= {f"{p}hc_{block}_fn": (mix, n * m), f"{p}hc_{block}_base": (mix,), f"{p}hc_{block}_scale": (3,)}
    a = p + "attn."
    shapes |= {a + "wq_a.weight": (q, m), a + "q_norm.weight": (q,), a + "wq_b.weight": (h * d, q),
               a + "wkv.weight": (d, m), a + "kv_norm.weight": (d,), a + "attn_sink": (h,),
               a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * d // cfg.o_groups),
               a + "wo_b.weight": (m, cfg.o_groups * cfg.o_lora_rank)}
    if kind in (CSA, HCA):
        c = 2 if kind == CSA else 1
        _compressor(shapes, a + "compressor.", c * d, d, ratio, m)
    if kind == CSA:
        g, di = cfg.index_n_heads, cfg.index_head_dim
        shapes |= {a + "indexer.wq_b.weight": (g * di, q), a + "indexer.weights_proj.weight": (g, m)}
        _compressor(shapes, a + "indexer.compressor.", 2 * di, di, ratio, m)
    f = p + "ffn."
    shapes[f + "gate.weight"] = (cfg.n_routed_experts, m)
    if mlp_kind == "hash_moe":
        shapes[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        shapes[f + "gate.bias"] = (cfg.n_routed_experts,)
    inter = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        _mlp(shapes, f"{f}experts.{e}.", m, inter)
    if cfg.n_shared_experts:
        _mlp(shapes, f + "shared_experts.", m, inter * cfg.n_shared_experts)


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
    return {canonical_name(name): (path, name) for name, path in stored.items()}


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
                       include: Callable[[str], bool] | None = None, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor the architecture needs (or those ``include`` accepts), validated and in
    ``dtype`` (the fp32 ones kept; ``tid2eid`` stays integer); nothing may be left over. ``mtp``:
    with the MTP layers the checkpoint holds (``model.weights_id.stored_mtp_layers``; else theirs are not read)."""
    ckpt = Path(ckpt_dir)
    where = _files(ckpt)
    want = expected_shapes(cfg, stored_mtp_layers(cfg, where) if mtp else 0)
    if not mtp:
        where = {n: at for n, at in where.items() if not n.startswith("mtp.")}
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
    experts: dict[int, ExpertWeights] = {}
    layers = [_layer(cfg, sd, i, cfg.layer_types[i], ropes, kernels_impl, experts) for i in range(cfg.num_hidden_layers)]
    mtp = []
    for k in range(stored_mtp_layers(cfg, sd)):
        p = f"mtp.{k}."
        layer = _layer(cfg, sd, cfg.num_hidden_layers + k, SLIDING, ropes, kernels_impl, experts)
        mtp.append(V4MtpLayer(sd[p + "enorm.weight"], sd[p + "hnorm.weight"], sd[p + "e_proj.weight"],
                              sd[p + "h_proj.weight"], layer, HyperHead(sd[p + "hc_head_fn"], sd[p + "hc_head_base"],
                                                                        sd[p + "hc_head_scale"]), sd[p + "norm.weight"]))
    embed = sd["embed.weight"]
    head = embed if cfg.tie_word_embeddings else sd["head.weight"]
    hc_head = HyperHead(sd["hc_head_fn"], sd["hc_head_base"], sd["hc_head_scale"])
    model = DeepseekV4Model(cfg, embed, layers, sd["norm.weight"], head, hc_head, ropes, kernels_impl, mtp)
    if experts:
        model.set_expert_executor(LocalExpertExecutor(experts, kernels_impl))
    return model


def _layer(cfg: V4Config, sd: dict[str, torch.Tensor], i: int, kind: str, ropes: dict[str, Rope], impl: str,
           experts: dict[int, ExpertWeights]) -> V4Layer:
    """Model layer ``i`` (an MTP layer after the model's) of attention ``kind``; its routed
    experts, when ``sd`` holds them, go into ``experts``."""
    p = layer_prefix(cfg, i)
    a, f = p + "attn.", p + "ffn."
    w = AttentionWeights(sd[a + "wq_a.weight"], sd[a + "q_norm.weight"], sd[a + "wq_b.weight"], sd[a + "wkv.weight"],
                         sd[a + "kv_norm.weight"], sd[a + "wo_a.weight"], sd[a + "wo_b.weight"], sd[a + "attn_sink"])
    if kind != SLIDING:
        w.compressor = _compressor_weights(sd, a + "compressor.")
    if kind == CSA:
        w.indexer = IndexerWeights(sd[a + "indexer.wq_b.weight"], sd[a + "indexer.weights_proj.weight"],
                                   _compressor_weights(sd, a + "indexer.compressor."))
    attn = Attention(cfg, i, w, ropes["main" if kind == SLIDING else "compress"], impl, kind)
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
    return V4Layer(sd[p + "attn_norm.weight"], attn, sd[p + "ffn_norm.weight"], V4MoE(cfg, i, gate, shared, impl),
                   _hc(sd, p + "hc_attn_"), _hc(sd, p + "hc_ffn_"))


def _compressor_weights(sd: dict[str, torch.Tensor], prefix: str) -> CompressorWeights:
    return CompressorWeights(sd[prefix + "wkv.weight"], sd[prefix + "wgate.weight"], sd[prefix + "ape"],
                             sd[prefix + "norm.weight"])


def _hc(sd: dict[str, torch.Tensor], prefix: str) -> HyperConnection:
    return HyperConnection(sd[prefix + "fn"], sd[prefix + "base"], sd[prefix + "scale"])


def load_v4(ckpt_dir: str | Path, cfg: V4Config, dtype: torch.dtype, impl: str = "auto", routed_experts: bool = True,
            device: torch.device = torch.device("cpu"), mtp: bool = False) -> DeepseekV4Model:
    """``routed_experts=False`` leaves the routed experts on disk (expert parallelism); ``mtp``:
    with the MTP layers the checkpoint holds (``model.mtp``)."""
    include = None if routed_experts else (lambda name: ".ffn.experts." not in name)
    sd = load_v4_state_dict(ckpt_dir, cfg, dtype, include, mtp)
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
