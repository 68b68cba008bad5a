"""What a model's KV costs: in a replica's pages, in the prompt cache, and to load a cached prefix.

One place for the figures the benchmarks print and ``docs/kv-layout.md`` tabulates, computed
from the same pool classes the engine uses (a one-page pool is built; nothing else is touched).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from model.config import ModelConfig
from model.v4.config import CSA, HCA, V4Config
from model.v4.kv import HybridKVPool

__all__ = ["KVSizes", "PUBLISHED", "kv_sizes"]

UNIT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class KVSizes:
    pool_bytes_per_token: float  # a replica's pages per token of a sequence, growing with it
    unit_bytes: int  # one 64-token unit in the prompt cache
    resume_bytes: int  # the record after a prefix's last unit (0: none needed)
    window_bytes_per_sequence: int = 0  # a running sequence's window pages, whatever its length (V4)

    def prefix_load_bytes(self, tokens: int) -> int:
        """Bytes a cache hit on a ``tokens``-token prompt reads: its whole units and, where the
        model needs one, the resume record after the last."""
        units = tokens // UNIT_TOKENS
        return units * self.unit_bytes + (self.resume_bytes if units else 0)


def kv_sizes(cfg: ModelConfig | V4Config, dtype: torch.dtype = torch.bfloat16, page_size: int = 16,
             draft_layers: int = 0) -> KVSizes:
    """``draft_layers``: MTP layers whose latents the pool and the units carry beside the
    model's (a replica that drafts with them, ``model.mtp``)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if isinstance(cfg, V4Config):
        pool = HybridKVPool(cfg, 1, page_size, dtype, draft_layers=draft_layers)
        entries = pool.entry_values_per_page() * size  # a page's compressed entries: kept as long as the sequence
        window = pool.nbytes() - entries  # a page's window rows: cluster.window_kv keeps about keep + a unit of them
        window_pages = -(-(cfg.window_keep + UNIT_TOKENS) // page_size) + 2
        return KVSizes(entries / page_size, UNIT_TOKENS * pool.row_dim * size, pool.resume_dim * size,
                       window_pages * window)
    row = (cfg.num_hidden_layers + draft_layers) * cfg.kv_dim * size
    # V2/V3/V3.2: a unit is its tokens' rows; nothing more is needed to go on after it
    return KVSizes(float(row), UNIT_TOKENS * row, 0)


def _v4(layers: int, hidden: int, heads: int, groups: int) -> V4Config:
    # transformers' default schedule (two HCA layers, then CSA and HCA in turn); the KV sizes
    # read only the layer kinds, the head and indexer dims, the window and the ratios
    kinds = (HCA, HCA, *[CSA if i % 2 else HCA for i in range(layers - 2)])
    return V4Config(vocab_size=129280, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=groups, o_lora_rank=1024,
                    layer_types=kinds, mlp_layer_types=("hash_moe",) * 3 + ("moe",) * (layers - 3))


_V3 = ModelConfig(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                  num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                  qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=2048, n_group=8, topk_group=4)
# the published models' KV shapes (bf16 KV), for what a cached prefix of theirs loads
PUBLISHED: dict[str, ModelConfig | V4Config] = {
    "deepseek-v3": _V3,
    "deepseek-v3.2": replace(_V3, model_type="deepseek_v32", index_topk=2048, index_n_heads=64, index_head_dim=128),
    "deepseek-v4-flash": _v4(43, 4096, 64, 8),
    "deepseek-v4-pro": _v4(61, 7168, 128, 16),
}
