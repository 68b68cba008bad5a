"""DeepSeek-V4: hybrid compressed attention over a sliding window, hyper-connections, hash-routed
MoE. Its own config, weights, pools and forward pass; the engine drives it as it drives
``model.model.DeepseekModel`` (``prefill`` / ``decode`` / ``mixed`` over a pool of pages)."""

from model.v4.config import V4Config

__all__ = ["V4Config"]
