"""Hugging Face DeepSeek checkpoints: expected tensors, loading, saving, random init.

Reads ``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
Every tensor the architecture needs must be present with the right shape and nothing else may be
left over (except the multi-token-prediction layers that real V3 checkpoints append after the last
decoder layer); anything else is a ``CheckpointError`` naming the tensor.

FP8 checkpoints as DeepSeek publishes V3 and R1 (``quantization_config`` with ``quant_method:
fp8`` and ``weight_block_size``; e4m3 weights, each with a ``weight_scale_inv`` per block) are
dequantized once at load (``w = q * scale_inv`` block by block) to the requested dtype, or, on
CUDA, kept as stored (``model.quant.Fp8Weight``) and multiplied by the block-scaled fp8 GEMMs.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels import resolve_impl
from kernels.fp8_gemm import dequantize_blocks
from model.config import DTYPE_NAMES, WEIGHTS_FILE, WEIGHTS_INDEX, ModelConfig, load_config
from model.dsa import Indexer, IndexerWeights
from model.layers import SwiGLU
from model.mla import MLA, MLAWeights
from model.model import DecoderLayer, DeepseekModel
from model.moe import ExpertWeights, Gate, LocalExpertExecutor, MoE
from model.mtp import MtpLayer, mtp_prefix
from model.quant import Fp8Weight
from model.v4.config import V4Config
from model.weights_id import CheckpointError, fp8_block_size, keeps_fp8, stored_mtp_layers

__all__ = [
    "CheckpointError",
    "LoadProgress",
    "dequantize_fp8",
    "fp8_block_size",
    "expected_shapes",
    "load_model",
    "load_state_dict",
    "build_model",
    "random_state_dict",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class LoadProgress(NamedTuple):
    """How far ``load_state_dict`` is: tensors, bytes (as stored) and shard files."""

    tensors: int
    total_tensors: int
    bytes: int
    total_bytes: int
    shards: int
    total_shards: int


Progress = Callable[[LoadProgress], None]
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


# the gates, and V3.2's indexer head weights, stay fp32 whatever the model's dtype (as in transformers)
_FP32_TENSORS = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv": the per-block scales of an fp8 "<name>.weight"


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An fp8 weight [N, K] times its per-block scales [ceil(N/bn), ceil(K/bk)], in float32."""
    n, k = q.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"weight scales of shape {tuple(scale_inv.shape)} for a [{n}, {k}] weight; "
                              f"{bn}x{bk} blocks need {want}")
    return dequantize_blocks(q, scale_inv.float(), block)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the architecture needs (with the MTP layers
    the config declares)."""
    m = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, m),
        "model.norm.weight": (m,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, m)
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        _layer_shapes(shapes, cfg, i)
    for k in range(cfg.num_nextn_predict_layers):  # the MTP layers' own tensors (their embedding and head: optional)
        p = mtp_prefix(cfg, k)
        shapes[p + "enorm.weight"] = shapes[p + "hnorm.weight"] = shapes[p + "shared_head.norm.weight"] = (m,)
        shapes[p + "eh_proj.weight"] = (m, 2 * m)
    return shapes


def _layer_shapes(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, i: int) -> None:
    """Decoder layer ``i``'s tensors (an MTP layer's decoder layer too)."""
    m, h = cfg.hidden_size, cfg.num_attention_heads
    p = f"model.layers.{i}."
    shapes[p + "input_layernorm.weight"] = (m,)
    shapes[p + "post_attention_layernorm.weight"] = (m,)
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (h * cfg.qk_head_dim, m)
    else:
        shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, m)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
        if cfg.attention_bias:
            shapes[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, m)
    shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[a + "kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes[a + "o_proj.weight"] = (m, h * cfg.v_head_dim)
    if cfg.attention_bias:
        shapes[a + "kv_a_proj_with_mqa.bias"] = (cfg.latent_dim,)
        shapes[a + "o_proj.bias"] = (m,)
    if cfg.index_topk:  # V3.2's lightning indexer
        g, d = cfg.index_n_heads, cfg.index_head_dim
        shapes[a + "indexer.wq_b.weight"] = (g * d, cfg.q_lora_rank)
        shapes[a + "indexer.wk.weight"] = (d, m)
        shapes[a + "indexer.k_norm.weight"] = (d,)
        shapes[a + "indexer.k_norm.bias"] = (d,)
        shapes[a + "indexer.weights_proj.weight"] = (g, m)
    f = p + "mlp."
    if cfg.is_moe_layer(i):
        inter = cfg.moe_intermediate_size
        shapes[f + "gate.weight"] = (cfg.n_routed_experts, m)
        if cfg.topk_method == "noaux_tc":
            shapes[f + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            _mlp_shapes(shapes, f"{f}experts.{e}.", m, inter)
        if cfg.n_shared_experts:
            _mlp_shapes(shapes, f + "shared_experts.", m, inter * cfg.n_shared_experts)
    else:
        _mlp_shapes(shapes, f, m, cfg.intermediate_size)


def _mtp_optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layers' tensors a checkpoint may store or share with the model's: their own
    embedding and LM head (DeepSeek's V3 checkpoints store copies)."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    return {mtp_prefix(cfg, k) + name: shape for k in range(cfg.num_nextn_predict_layers)
            for name in ("embed_tokens.weight", "shared_head.head.weight")}


def _mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, m: int, inter: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (inter, m)
    shapes[prefix + "up_proj.weight"] = (inter, m)
    shapes[prefix + "down_proj.weight"] = (m, inter)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _shard_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it."""
    index = ckpt / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt / fname for name, fname in weight_map.items()}
    single = ckpt / WEIGHTS_FILE
    if not single.is_file():
        raise CheckpointError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {ckpt}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def load_state_dict(
    ckpt_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    include: Callable[[str], bool] | None = None,
    keep_fp8: bool = False,
) -> dict[str, torch.Tensor | Fp8Weight]:
    """Read and validate every tensor (or those ``include`` accepts); converts to ``dtype``
    (gates stay fp32). The checkpoint must still hold every tensor the architecture names.
    ``keep_fp8``: an fp8 checkpoint's projections come as ``Fp8Weight`` (e4m3 with their
    scales, as stored), except ``kv_b_proj``, which the absorbed attention splits."""
    ckpt = Path(ckpt_dir)
    where = _shard_files(ckpt)
    want = _stored_shapes(cfg, where)
    block = fp8_block_size(ckpt)
    extra = []
    for name in where:
        if name in want:
            continue
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # layers past those the config declares (or MTP layers it does not): not used
        if block is not None and name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in want:
            continue  # an fp8 weight's scales
        extra.append(name)
    if extra:
        hint = (" (an fp8 checkpoint's scales: its config.json needs quantization_config with quant_method fp8)"
                if any(n.endswith(SCALE_SUFFIX) for n in extra) else "")
        raise CheckpointError(f"unexpected tensor {extra[0]!r} ({len(extra)} in all){hint}")
    missing = [n for n in want if n not in where]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} in all)")
    if include is not None:
        want = {name: shape for name, shape in want.items() if include(name)}
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(where[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    total_bytes = _stored_bytes(by_file) if progress is not None else 0
    done = done_bytes = 0
    for shard, (path, names) in enumerate(by_file.items(), start=1):
        with safe_open(path, "pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if tuple(t.shape) != want[name]:
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(t.shape)}, config needs {want[name]}"
                    )
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {name!r} has non-float dtype {t.dtype}")
                keep_fp32 = name.endswith(_FP32_TENSORS)
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    scale = _scales(name, t, where, block, path, f)
                    if keep_fp8 and t.dtype == torch.float8_e4m3fn and not name.endswith("kv_b_proj.weight"):
                        out[name] = Fp8Weight(t, scale.float(), block)
                    else:
                        out[name] = dequantize_fp8(t, scale, block).to(dtype)
                else:
                    out[name] = t.to(torch.float32 if keep_fp32 else dtype)
                done += 1
                done_bytes += t.numel() * t.element_size()
                if progress is not None:
                    shards_read = shard - (name != names[-1])
                    progress(LoadProgress(done, len(want), done_bytes, total_bytes, shards_read, len(by_file)))
    return out


def _stored_shapes(cfg: ModelConfig, where: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """``expected_shapes`` of the checkpoint as stored: its MTP layers only where it holds them
    (published conversions often drop them and keep the config), and their own embedding and
    head where it stores them."""
    want = expected_shapes(cfg)
    stored = stored_mtp_layers(cfg, where)
    for k in range(stored, cfg.num_nextn_predict_layers):
        prefix = mtp_prefix(cfg, k)
        for name in [n for n in want if n.startswith(prefix)]:
            del want[name]
    want.update({n: shape for n, shape in _mtp_optional(cfg).items() if n in where})
    return want


def _scales(name: str, q: torch.Tensor, where: dict[str, Path], block: tuple[int, int] | None,
            path: Path, shard) -> torch.Tensor:
    """The scales of ``q`` (from ``shard``, the open file ``path``), wherever the index puts them."""
    scales = where.get(name + SCALE_SUFFIX)
    if block is None or scales is None or q.dim() != 2:
        raise CheckpointError(f"tensor {name!r} is {q.dtype} without {name + SCALE_SUFFIX!r} and an fp8 "
                              "quantization_config: it cannot be dequantized")
    if scales == path:
        return shard.get_tensor(name + SCALE_SUFFIX)
    with safe_open(scales, "pt") as f:
        return f.get_tensor(name + SCALE_SUFFIX)


def _stored_bytes(by_file: dict[Path, list[str]]) -> int:
    """Bytes of the named tensors as stored (from the files' headers; nothing is read)."""
    total = 0
    for path, names in by_file.items():
        with safe_open(path, "pt") as f:
            for name in names:
                sl = f.get_slice(name)
                total += math.prod(sl.get_shape()) * _ITEMSIZE.get(sl.get_dtype(), 4)
    return total


def build_model(cfg: ModelConfig | V4Config, sd: dict[str, torch.Tensor], impl: str = "auto") -> DeepseekModel:
    """Assemble a model from a validated HF-named state dict (tensors are used, not copied,
    except where experts are stacked). ``impl``: ``auto`` (Triton kernels on CUDA, torch
    elsewhere), ``ref`` or ``triton`` (see ``kernels.resolve_impl``). Without routed-expert
    tensors in ``sd`` the model gets no expert executor: the caller sets one (expert parallelism).
    A V4 config builds ``model.v4.model.DeepseekV4Model`` from Hub-named tensors."""
    if isinstance(cfg, V4Config):
        from model.v4.checkpoint import build_v4

        return build_v4(cfg, sd, impl)
    kernels_impl = resolve_impl(impl, sd["model.embed_tokens.weight"].device)

    def mlp(prefix: str) -> SwiGLU:
        gate_up = sd.get(prefix + "gate_up_proj.weight")  # already fused (the trainer holds it so)
        if gate_up is None:
            gate_up = _cat_rows(sd[prefix + "gate_proj.weight"], sd[prefix + "up_proj.weight"])
        return SwiGLU(gate_up, sd[prefix + "down_proj.weight"])

    layers, experts = [], {}
    for i in range(cfg.num_hidden_layers):
        layers.append(_decoder_layer(cfg, sd, i, kernels_impl, experts, mlp))
    embed = sd["model.embed_tokens.weight"]
    lm_head = embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
    mtp = []
    for k in range(cfg.num_nextn_predict_layers):
        p = mtp_prefix(cfg, k)
        if p + "eh_proj.weight" not in sd:
            break  # not loaded (or not stored)
        layer = _decoder_layer(cfg, sd, cfg.num_hidden_layers + k, kernels_impl, experts, mlp)
        mtp.append(MtpLayer(sd[p + "enorm.weight"], sd[p + "hnorm.weight"], sd[p + "eh_proj.weight"], layer,
                            sd[p + "shared_head.norm.weight"], sd.get(p + "embed_tokens.weight", embed),
                            sd.get(p + "shared_head.head.weight", lm_head)))
    model = DeepseekModel(cfg, embed, layers, sd["model.norm.weight"], lm_head, kernels_impl, mtp)
    if experts:
        model.set_expert_executor(LocalExpertExecutor(experts, kernels_impl))
    return model


def _decoder_layer(cfg: ModelConfig, sd: dict, i: int, kernels_impl: str, experts: dict,
                   mlp: Callable[[str], SwiGLU]) -> DecoderLayer:
    """Decoder layer ``i`` from ``sd`` (its routed experts, when there, stacked into ``experts``)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    w = MLAWeights(
        kv_a=sd[a + "kv_a_proj_with_mqa.weight"],
        kv_a_norm=sd[a + "kv_a_layernorm.weight"],
        kv_b=sd[a + "kv_b_proj.weight"],
        o=sd[a + "o_proj.weight"],
        q=sd.get(a + "q_proj.weight"),
        q_a=sd.get(a + "q_a_proj.weight"),
        q_a_norm=sd.get(a + "q_a_layernorm.weight"),
        q_b=sd.get(a + "q_b_proj.weight"),
        kv_a_bias=sd.get(a + "kv_a_proj_with_mqa.bias"),
        q_a_bias=sd.get(a + "q_a_proj.bias"),
        o_bias=sd.get(a + "o_proj.bias"),
    )
    f = p + "mlp."
    ffn: SwiGLU | MoE
    if cfg.is_moe_layer(i):
        gate = Gate(sd[f + "gate.weight"], sd.get(f + "gate.e_score_correction_bias"))
        shared = mlp(f + "shared_experts.") if cfg.n_shared_experts else None
        ffn = MoE(cfg, i, gate, shared, kernels_impl)
        if f + "experts.0.gate_proj.weight" in sd:
            experts[i] = _stack_experts(sd, f, range(cfg.n_routed_experts))
    else:
        ffn = mlp(f)
    indexer = None
    if cfg.index_topk:
        x = a + "indexer."
        indexer = Indexer(cfg, IndexerWeights(sd[x + "wq_b.weight"], sd[x + "wk.weight"], sd[x + "k_norm.weight"],
                                              sd[x + "k_norm.bias"], sd[x + "weights_proj.weight"]))
    return DecoderLayer(
        sd[p + "input_layernorm.weight"], MLA(cfg, w), sd[p + "post_attention_layernorm.weight"], ffn, indexer
    )


def _cat_rows(gate: torch.Tensor | Fp8Weight, up: torch.Tensor | Fp8Weight) -> torch.Tensor | Fp8Weight:
    """gate's rows, then up's: fp8 weights stay fp8 when gate ends on a scale block."""
    if isinstance(gate, Fp8Weight) and isinstance(up, Fp8Weight):
        fused = Fp8Weight.cat_rows([gate, up])
        if fused is not None:
            return fused
    dense = [w.dequantize() if isinstance(w, Fp8Weight) else w for w in (gate, up)]
    return torch.cat(dense)


def _stack_experts(sd: dict[str, torch.Tensor | Fp8Weight], prefix: str, expert_ids) -> ExpertWeights:
    gate_up = [_cat_rows(sd[f"{prefix}experts.{e}.gate_proj.weight"], sd[f"{prefix}experts.{e}.up_proj.weight"])
               for e in expert_ids]
    down = [sd[f"{prefix}experts.{e}.down_proj.weight"] for e in expert_ids]
    if not all(isinstance(w, Fp8Weight) for w in gate_up + down):  # a layer's experts are fp8 or dense, all
        gate_up, down = ([w.dequantize() if isinstance(w, Fp8Weight) else w for w in ws] for ws in (gate_up, down))
    return ExpertWeights.stack(gate_up, down)


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def load_expert_slots(
    ckpt_dir: str | Path, slot_experts: dict[int, list[int]], dtype: str | torch.dtype = "float32",
    keep_fp8: bool = False,
) -> dict[int, ExpertWeights]:
    """The routed experts that fill one shard's slots: ``slot_experts`` maps a model layer index
    to the logical expert of each slot (repeats allowed across shards, not needed within).
    Returns, per layer, weights stacked in slot order ([slots, 2I, M] and [slots, M, I]);
    ``keep_fp8``: an fp8 checkpoint's experts stay e4m3 as stored (``keeps_fp8``)."""
    dtype = _dtype(dtype)
    cfg = load_config(ckpt_dir)
    if isinstance(cfg, V4Config):  # Hub names, the clipped SwiGLU
        from model.v4.checkpoint import layer_prefix, load_v4_state_dict

        def at(layer: int, e: int, w: str) -> str:
            return f"{layer_prefix(cfg, layer)}ffn.experts.{e}.{w}.weight"

        wanted = {at(layer, e, w) for layer, experts in slot_experts.items() for e in experts for w in ("w1", "w2", "w3")}
        drafts = any(layer >= cfg.num_hidden_layers for layer in slot_experts)  # an MTP layer's experts
        sd = load_v4_state_dict(ckpt_dir, cfg, dtype, include=wanted.__contains__, mtp=drafts)
        return {layer: ExpertWeights.stack(
            [torch.cat((sd[at(layer, e, "w1")], sd[at(layer, e, "w3")])) for e in experts],
            [sd[at(layer, e, "w2")] for e in experts], cfg.swiglu_limit)
            for layer, experts in slot_experts.items()}
    names = {
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer, experts in slot_experts.items()
        for e in experts
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    sd = load_state_dict(ckpt_dir, cfg, dtype, include=names.__contains__, keep_fp8=keep_fp8)
    return {layer: _stack_experts(sd, f"model.layers.{layer}.mlp.", experts) for layer, experts in slot_experts.items()}


def load_model(
    ckpt_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    progress: Progress | None = None,
    impl: str = "auto",
    routed_experts: bool = True,
    device: str | torch.device = "cpu",
    cpu_weights: str = "fp32",
    fp8_weights: str = "auto",
    mtp: bool = False,
) -> DeepseekModel:
    """``routed_experts=False`` leaves the routed experts on disk (an attention replica under
    expert parallelism, whose executor sends tokens to expert shards). ``device``: where the
    weights and the latent pool live (``cuda`` selects the Triton kernels under ``impl="auto"``).
    ``cpu_weights="int8"``: a float32 CPU model holds its projections and experts as int8 with
    per-block scales (``model.quant``: a quarter of the bytes a decode step streams).
    ``fp8_weights`` (``model.quant.FP8_WEIGHTS``): whether an fp8 checkpoint's projections and
    experts stay e4m3 as stored (``Fp8Weight``, the fp8 GEMMs) or are dequantized at load.
    ``mtp``: load the multi-token-prediction layers the checkpoint holds (``model.mtp``; the
    speculative decoding draft; without ``routed_experts`` theirs are left on disk too)."""
    from model.quant import CPU_WEIGHTS, quantize_model

    if cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"unsupported cpu_weights {cpu_weights!r}; supported: {', '.join(CPU_WEIGHTS)}")
    dtype = _dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine")
    if cpu_weights == "int8" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"cpu_weights 'int8' needs a float32 model on the CPU, not {dtype} on {device}")
    keep_fp8 = keeps_fp8(ckpt_dir, device, fp8_weights)
    if keep_fp8 and cpu_weights != "fp32":
        raise ValueError(f"cpu_weights {cpu_weights!r} and fp8 weights kept as stored: choose one")
    cfg = load_config(ckpt_dir)
    if not isinstance(cfg, ModelConfig):  # DeepSeek-V4: its own weights and pools
        from model.v4.checkpoint import load_v4

        if cpu_weights != "fp32":  # its fp8 and fp4 weights are dequantized: no V4 kernel takes them yet
            raise ValueError(f"cpu_weights {cpu_weights!r}: DeepSeek-V4 loads its weights in the model's dtype")
        return load_v4(ckpt_dir, cfg, dtype, impl, routed_experts, device, mtp)
    include = _include(cfg, routed_experts, mtp)
    sd = load_state_dict(ckpt_dir, cfg, dtype, progress, include, keep_fp8=keep_fp8)
    for name in sd:  # one tensor at a time, so host memory holds at most one extra copy
        sd[name] = sd[name].to(device)
    model = build_model(cfg, sd, impl)
    if cpu_weights == "int8":
        del sd  # the fp32 copies go as each weight is quantized
        quantize_model(model)
    return model


def _include(cfg: ModelConfig, routed_experts: bool, mtp: bool) -> Callable[[str], bool] | None:
    """Which tensors ``load_model`` reads: without routed experts none of theirs, without MTP
    none of the MTP layers'."""
    if routed_experts and mtp:
        return None
    drafts = tuple(mtp_prefix(cfg, k) for k in range(cfg.num_nextn_predict_layers)) if not mtp else ()
    return lambda name: not (not routed_experts and is_routed_expert(name)) and not name.startswith(drafts)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def random_state_dict(cfg: ModelConfig | V4Config, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Deterministic random weights (norms at 1, biases at 0), same on every machine."""
    if isinstance(cfg, V4Config):
        from model.v4.checkpoint import random_v4_state_dict

        return random_v4_state_dict(cfg, seed, std)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            sd[name] = torch.ones(shape)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            sd[name] = torch.zeros(shape)
        else:
            sd[name] = torch.randn(shape, generator=gen) * std
    return sd


def save_checkpoint(
    ckpt_dir: str | Path, cfg: ModelConfig | V4Config, sd: dict[str, torch.Tensor],
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (atomically: temp name, then rename)."""
    ckpt = Path(ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(ckpt / WEIGHTS_FILE)
    (ckpt / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    for fname, text in (extra_files or {}).items():
        (ckpt / fname).write_text(text)
    return ckpt
