"""Model configuration read from a Hugging Face DeepSeek-V2/V3/V3.2 ``config.json``.

``ModelConfig`` is the single description of the architecture that every other part of
tideserve uses (the cache fingerprint hashes it, the engine sizes its KV pool from it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model.v4.config import V4Config

__all__ = ["DTYPE_NAMES", "ModelConfig", "check_checkpoint_dir", "RopeScaling", "load_config", "named_config", "NAMED_CONFIGS"]

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")  # ModelConfig's families
SUPPORTED_MODEL_TYPES = (*MLA_MODEL_TYPES, "deepseek_v4")  # what a checkpoint may be (V4: model.v4)
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # the weight/KV dtypes a model loads in


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """YaRN parameters as DeepSeek configs give them (``rope_scaling`` / ``rope_parameters``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # MoE (n_routed_experts == 0 means a dense model)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # position encoding
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # DeepSeek Sparse Attention (V3.2): a lightning indexer per layer keeps each query's top
    # ``index_topk`` earlier tokens (0: every layer attends densely, V2/V3)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # multi-token prediction: layers after the last decoder layer that predict the token after
    # the next (the speculative decoding draft, ``model.mtp``)
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in MLA_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if (self.model_type == "deepseek_v32") != (self.index_topk > 0):
            raise ValueError(f"index_topk={self.index_topk}: DeepSeek-V3.2 (and only it) needs an indexer")
        if self.index_topk:
            if self.index_n_heads <= 0 or self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(f"index_n_heads={self.index_n_heads} must be > 0 and index_head_dim="
                                 f"{self.index_head_dim} >= qk_rope_head_dim={self.qk_rope_head_dim}")
            if self.q_lora_rank is None:
                raise ValueError("DeepSeek-V3.2's indexer reads the query's low-rank path: q_lora_rank is needed")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, n_routed_experts={self.n_routed_experts}]"
                )
            if self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ValueError(f"unsupported scoring_func {self.scoring_func!r}")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ValueError(f"unsupported topk_method {self.topk_method!r}")
            if self.moe_layer_freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")

    # -- derived sizes --------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent KV cache: ``c_kv`` then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Values per token per layer that the KV pools hold: the latent, then the indexer key
        (V3.2). A cache unit carries these rows for its 64 tokens."""
        return self.latent_dim + self.index_head_dim

    @property
    def kv_layout(self) -> str:
        """The KV a cache unit holds, named for the cache namespace."""
        layout = f"mla-latent:{self.kv_lora_rank}+{self.qk_rope_head_dim}"
        return layout if not self.index_topk else f"{layout}+index:{self.index_head_dim}"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's correction)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def fingerprint(self) -> str:
        """Stable digest of the architecture (part of the cache namespace)."""
        blob = json.dumps(self._fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content that Hugging Face and tideserve both read."""
        d = self._fields()
        d.pop("rope_scaling")
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        d["num_key_value_heads"] = self.num_attention_heads
        d["hidden_act"] = "silu"
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        return d

    def _fields(self) -> dict[str, Any]:
        """The fields, without the indexer's or the MTP layers' count where there are none: a
        V2/V3 config's file and fingerprint name neither."""
        d = dataclasses.asdict(self)
        if not self.num_nextn_predict_layers:
            d.pop("num_nextn_predict_layers")
        if not self.index_topk:
            for name in ("index_topk", "index_n_heads", "index_head_dim"):
                d.pop(name)
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in MLA_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; DeepSeek models use 'silu'")
        is_v3 = model_type in ("deepseek_v3", "deepseek_v32")
        sparse = model_type == "deepseek_v32"
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "yarn":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(rope.get("mscale") or 1.0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, yarn")
        n_routed = raw.get("n_routed_experts") or 0
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            q_lora_rank=raw.get("q_lora_rank"),
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 1,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            scoring_func=raw.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
            topk_method=raw.get("topk_method", "noaux_tc" if is_v3 else "greedy"),
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            rope_theta=float(rope_theta),
            # DeepSeek-V2 and V3.2 always rotate interleaved pairs; V3 configs say which.
            rope_interleave=bool(raw.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            index_topk=int(raw.get("index_topk", 2048)) if sparse else 0,
            index_n_heads=int(raw.get("index_n_heads", 64)) if sparse else 0,
            index_head_dim=int(raw.get("index_head_dim", 128)) if sparse else 0,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )


_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "deepseek_v32": "DeepseekV32ForCausalLM"}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def load_config(checkpoint_dir: str | Path) -> ModelConfig | V4Config:
    """The checkpoint's config: a ``ModelConfig`` (V2, V3, V3.2: MLA) or a ``model.v4.V4Config``."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {checkpoint_dir}")
    raw = json.loads(path.read_text())
    if isinstance(raw, dict) and raw.get("model_type") == "deepseek_v4":
        from model.v4.config import V4Config  # V4's module imports this one

        return V4Config.from_hf_dict(raw)
    return ModelConfig.from_hf_dict(raw)


WEIGHTS_FILE = "model.safetensors"  # a checkpoint's weights: this file, or the index of its shards
WEIGHTS_INDEX = "model.safetensors.index.json"


def check_checkpoint_dir(checkpoint_dir: str | Path) -> ModelConfig | V4Config:
    """What a server checks before it starts replicas: the directory has a supported
    ``config.json`` and its weights (``model.safetensors`` or a sharded index). ``ValueError``
    naming the directory and the problem otherwise (cheap: no weights are read, no torch)."""
    ckpt = Path(checkpoint_dir)
    try:
        cfg = load_config(ckpt)
    except (OSError, ValueError, TypeError, KeyError) as e:  # missing, not JSON, unsupported, incomplete
        raise ValueError(f"checkpoint {str(ckpt)!r}: {e}") from None
    if not ((ckpt / WEIGHTS_FILE).is_file() or (ckpt / WEIGHTS_INDEX).is_file()):
        raise ValueError(f"checkpoint {str(ckpt)!r} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX}")
    return cfg


_TINY = ModelConfig(
    model_type="deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=768,
    num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
    scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257,
)

_BENCH = ModelConfig(
    model_type="deepseek_v3", vocab_size=4096, hidden_size=512, intermediate_size=1536,
    num_hidden_layers=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
    qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32,
    n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=256, first_k_dense_replace=1,
    scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
)

# V3.2 configs: the V3 ones with an indexer whose top-k a long prompt passes
_TINY_V32 = dataclasses.replace(_TINY, model_type="deepseek_v32", index_topk=64, index_n_heads=4, index_head_dim=32)
_BENCH_V32 = dataclasses.replace(_BENCH, model_type="deepseek_v32", index_topk=512, index_n_heads=8,
                                 index_head_dim=64)

NAMED_CONFIGS: dict[str, ModelConfig | V4Config] = {"tiny": _TINY, "bench": _BENCH, "tiny-v3.2": _TINY_V32,
                                                    "bench-v3.2": _BENCH_V32}


def named_config(name: str) -> ModelConfig | V4Config:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(NAMED_CONFIGS)}") from None


# V4's configs live with V4 (whose module reads RopeScaling from this one, defined above)
from model.v4.config import V4_NAMED_CONFIGS  # noqa: E402

NAMED_CONFIGS.update(V4_NAMED_CONFIGS)
