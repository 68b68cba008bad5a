"""DeepSeek-V4's configuration, from its Hugging Face ``config.json``.

Each layer attends over a sliding window of ``sliding_window`` tokens (one shared K=V head of
``head_dim``), plus compressed entries: one per ``csa_ratio`` tokens chosen by an indexer (CSA,
compressed sparse attention), or one per ``hca_ratio`` tokens all attended (HCA, heavily
compressed). The residual stream is ``hc_mult`` streams mixed by hyper-connections; the first
``hash_moe`` layers route experts by token id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from model.config import SUPPORTED_MODEL_TYPES, RopeScaling

__all__ = ["LAYER_KINDS", "V4Config", "V4_NAMED_CONFIGS"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # older configs' per-layer compress_ratios


@dataclass(frozen=True, slots=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int  # the trailing dims of each head that RoPE rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]  # "hash_moe" | "moe"
    sliding_window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"  # "sqrtsoftplus" | "sigmoid" | "softmax"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0  # sliding-only layers
    compress_rope_theta: float = 160000.0  # layers with a compressor, and the compressors
    compress_rope_scaling: RopeScaling | None = None  # YaRN of the compressed layers' RoPE
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "deepseek_v4"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "hc_mult"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_hidden_layers or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types ({len(self.layer_types)}) and mlp_layer_types "
                             f"({len(self.mlp_layer_types)}) need one entry per layer ({self.num_hidden_layers})")
        bad = [t for t in self.layer_types if t not in LAYER_KINDS] + \
            [t for t in self.mlp_layer_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ValueError(f"unsupported layer type {bad[0]!r}; supported: {LAYER_KINDS}, hash_moe, moe")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and in (0, head_dim]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide heads x head_dim")
        if CSA in self.layer_types and not (self.index_topk > 0 and self.index_n_heads > 0
                                            and self.qk_rope_head_dim <= self.index_head_dim):
            raise ValueError(f"compressed sparse attention needs index_topk > 0, index_n_heads > 0 and "
                             f"index_head_dim >= qk_rope_head_dim, got {self.index_topk}, "
                             f"{self.index_n_heads}, {self.index_head_dim}")
        # a unit holds whole CSA windows; whole HCA windows, or an HCA window whole units
        if self.csa_ratio < 1 or 64 % self.csa_ratio:
            raise ValueError(f"csa_ratio must divide 64, got {self.csa_ratio}")
        if self.hca_ratio < 1 or 64 % self.hca_ratio and self.hca_ratio % 64:
            raise ValueError(f"hca_ratio must divide 64 or be a multiple of it, got {self.hca_ratio}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unsupported scoring_func {self.scoring_func!r}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.n_routed_experts}]")

    # -- the surface the engine and the cache read (as ModelConfig's) ------------------------
    def ratio(self, layer_idx: int) -> int:
        """Tokens per compressed entry of a layer (0: sliding window only)."""
        kind = self.layer_types[layer_idx]
        return 0 if kind == SLIDING else self.csa_ratio if kind == CSA else self.hca_ratio

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True  # every V4 layer's FFN is routed (hash or top-k)

    @property
    def first_k_dense_replace(self) -> int:
        return 0

    @property
    def n_group(self) -> int:
        return 1  # V4 routes without expert groups (EPLB's hierarchy then has one group)

    @property
    def window_keep(self) -> int:
        """Positions behind the next token whose per-token rows going on reads: its window, the
        compressor inputs of the entries it may close (two CSA windows, one HCA window)."""
        return max(self.sliding_window, 2 * self.csa_ratio, self.hca_ratio)

    @property
    def kv_layout(self) -> str:
        """The KV a cache unit holds, named for the cache namespace (``model.v4.kv``'s unit)."""
        kinds = "".join({SLIDING: "s", CSA: "c", HCA: "h"}[t] for t in self.layer_types)
        return (f"v4-hybrid:{kinds}:w{self.sliding_window}:c{self.csa_ratio}:h{self.hca_ratio}:"
                f"d{self.head_dim}+i{self.index_head_dim}")

    def fingerprint(self) -> str:
        """Stable digest of the architecture (part of the cache namespace)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content that Hugging Face and tideserve both read."""
        d = dataclasses.asdict(self)
        for name in ("csa_ratio", "hca_ratio", "compress_rope_scaling", "qk_rope_head_dim"):
            d.pop(name)
        d["layer_types"], d["mlp_layer_types"] = list(self.layer_types), list(self.mlp_layer_types)
        d["compress_rates"] = {CSA: self.csa_ratio, HCA: self.hca_ratio}
        d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["num_key_value_heads"] = 1
        d["hidden_act"] = "silu"
        if self.compress_rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.compress_rope_scaling)}
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> V4Config:
        if raw.get("model_type") != "deepseek_v4":
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; DeepSeek models use 'silu'")
        n = raw["num_hidden_layers"]
        rates = dict(raw.get("compress_rates") or {})
        csa = int(rates.get(CSA, raw.get("compress_rate_csa", 4)))
        hca = int(rates.get(HCA, raw.get("compress_rate_hca", 128)))
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            layer_types = [_RATIO_KIND[r] if r in _RATIO_KIND else (CSA if r == csa else HCA)
                           for r in raw["compress_ratios"]]
        if layer_types is None:  # V4-Pro's default: two HCA layers, then HCA / CSA in turn
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = raw.get("head_dim", 512)
        rope_dim = raw.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=n,
            num_attention_heads=raw["num_attention_heads"], head_dim=head_dim, qk_rope_head_dim=rope_dim,
            q_lora_rank=raw["q_lora_rank"], o_groups=raw.get("o_groups", 8), o_lora_rank=raw.get("o_lora_rank", 1024),
            layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp_types[:n]),
            sliding_window=raw.get("sliding_window", 128), csa_ratio=csa, hca_ratio=hca,
            index_n_heads=raw.get("index_n_heads", 64), index_head_dim=raw.get("index_head_dim", 128),
            index_topk=raw.get("index_topk", 512), n_routed_experts=raw.get("n_routed_experts", 256),
            num_experts_per_tok=raw.get("num_experts_per_tok", 6),
            moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
            n_shared_experts=raw.get("n_shared_experts", 1), scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)), hc_mult=raw.get("hc_mult", 4),
            hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20), hc_eps=float(raw.get("hc_eps", 1e-6)),
            rope_theta=float(_rope(raw, "main").get("rope_theta", raw.get("rope_theta", 10000.0))),
            compress_rope_theta=float(_rope(raw, "compress").get("rope_theta",
                                                                 raw.get("compress_rope_theta", 160000.0))),
            compress_rope_scaling=_yarn(_rope(raw, "compress") or raw.get("rope_scaling") or {}),
            max_position_embeddings=raw.get("max_position_embeddings", 1048576),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"), eos_token_id=eos,
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0),
        )


def _rope(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    params = raw.get("rope_parameters") or {}
    sub = params.get(kind)
    return sub if isinstance(sub, dict) else {}


def _yarn(rope: dict[str, Any]) -> RopeScaling | None:
    """YaRN of the compressed layers (V4 applies no YaRN attention factor to cos/sin)."""
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return None
    return RopeScaling(factor=float(rope["factor"]),
                       original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1))



def _named(vocab: int, hidden: int, layers: int, heads: int, head_dim: int, window: int, hca: int, experts: int,
           **kw: Any) -> V4Config:
    # V4-Pro's pattern (two HCA layers, then CSA and HCA in turn) after a sliding-only first layer,
    # three hash-routed layers first
    kinds = (SLIDING, HCA, *[CSA if i % 2 == 0 else HCA for i in range(layers - 2)])
    return V4Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
        qk_rope_head_dim=head_dim // 4, q_lora_rank=hidden // 2, o_groups=2, o_lora_rank=head_dim,
        layer_types=kinds[:layers], mlp_layer_types=tuple("hash_moe" if i < 3 else "moe" for i in range(layers)),
        sliding_window=window, hca_ratio=hca, n_routed_experts=experts, moe_intermediate_size=hidden // 2,
        max_position_embeddings=8192, bos_token_id=kw.pop("bos_token_id"), eos_token_id=kw.pop("eos_token_id"), **kw)


V4_NAMED_CONFIGS = {
    "tiny-v4": _named(512, 256, 4, 4, 64, window=32, hca=64, experts=16, num_experts_per_tok=2, index_n_heads=4,
                      index_head_dim=32, index_topk=16, bos_token_id=256, eos_token_id=257),
    "bench-v4": _named(4096, 512, 8, 8, 128, window=128, hca=128, experts=32, num_experts_per_tok=4,
                       index_n_heads=8, index_head_dim=64, index_topk=128, bos_token_id=0, eos_token_id=1),
}
