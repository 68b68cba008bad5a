"""Small random DeepSeek-V2/V3/V3.2/V4 checkpoints written by ``transformers`` (the numerical reference)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

BASE = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512, initializer_range=0.15,
    rope_theta=10000.0,
)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

SHAPES = {
    # V3, query low-rank path, group-limited routing, YaRN, one dense first layer
    "v3_grouped_yarn": ("v3", dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                   rope_scaling=YARN)),
    # V3, ungrouped routing, no YaRN, half-split RoPE, all layers MoE
    "v3_ungrouped": ("v3", dict(q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=0,
                                rope_interleave=False, norm_topk_prob=False)),
    # V2-Lite style: no q_lora_rank, greedy softmax routing, YaRN, dense first layer
    "v2_lite_yarn": ("v2", dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1,
                                rope_scaling=YARN)),
    # V2 with q_lora_rank and group-limited greedy routing
    "v2_group_limited": ("v2", dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=4,
                                    topk_group=2, first_k_dense_replace=2, routed_scaling_factor=1.5)),
    # V3.2: every layer's indexer keeps 16 keys a query (the tests' prompts run past it), YaRN;
    # 32 indexer heads: with 8, scores of exactly 0 (every head's ReLU at 0) tied at the k-th
    # place, where transformers' topk and ours keep different keys
    "v32_sparse_yarn": ("v32", dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                    rope_scaling=YARN, index_topk=16, index_head_dim=16, index_n_heads=32)),
    # V4: a sliding layer (window 8), CSA (an entry per 4 tokens, the indexer keeps 4) and HCA (an
    # entry per 16) layers, a hash-routed first layer, YaRN on the compressed layers' RoPE
    "v4_hybrid_yarn": ("v4", dict(
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, sliding_window=8, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=16, index_topk=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], rope_scaling=YARN)),
}
# V4 has no MLA, no dense layers and no expert groups
V4_BASE = dict(vocab_size=160, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=512,
               initializer_range=0.15)


def make_hf_checkpoint(name: str, out_dir: Path, seed: int = 0):
    """Write the named shape as an HF checkpoint; returns the transformers model (eval mode)."""
    import transformers

    family, extra = SHAPES[name]
    extra = copy.deepcopy(extra)  # transformers' configs write into the rope dicts they are given
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"), "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"), "v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    }[family]
    base = V4_BASE if family == "v4" else BASE
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**base, **extra))
    with torch.no_grad():  # a non-zero correction bias exercises the V3 choice/weight split
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
            if buf_name.endswith("tid2eid"):  # transformers leaves the hash table at zeros
                buf.copy_(torch.randint(0, base["n_routed_experts"], buf.shape))
        for name, param in model.named_parameters():  # V4's sinks, gate biases, mHC biases: 0 at init
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(out_dir)
    return model


def add_v4_mtp_layer(out_dir: Path, seed: int = 0) -> None:
    """Give a V4 checkpoint that transformers wrote (it declares an MTP layer and drops it) a
    random one, as DeepSeek stores it (``mtp.0.*``)."""
    from safetensors.torch import load_file, save_file

    from model.config import load_config
    from model.v4.checkpoint import random_v4_state_dict

    cfg = load_config(out_dir)
    assert cfg.num_nextn_predict_layers >= 1
    mtp = {k: v for k, v in random_v4_state_dict(cfg, seed, std=0.1).items() if k.startswith("mtp.")}
    path = Path(out_dir) / "model.safetensors"
    save_file({**load_file(str(path)), **mtp}, str(path), metadata={"format": "pt"})
