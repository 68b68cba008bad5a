"""DeepSeek-V2/V3 architecture: config, MLA, MoE, latent KV pool, loading, tokenizer, sampling.

Single device, no Ray, no scheduling."""

from model.checkpoint import CheckpointError, load_model
from model.config import ModelConfig, load_config, named_config
from model.generate import generate
from model.kv_cache import LatentKVPool
from model.model import DeepseekModel
from model.sampling import SamplingParams

__all__ = [
    "CheckpointError",
    "DeepseekModel",
    "LatentKVPool",
    "ModelConfig",
    "SamplingParams",
    "generate",
    "load_config",
    "load_model",
    "named_config",
]
