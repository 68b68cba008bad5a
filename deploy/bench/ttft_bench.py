"""``tide bench ttft``: time to first token for a long prompt, cold vs from the SSD and RAM tiers."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cachedir.hashing import Namespace
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from model.checkpoint import load_model, random_state_dict, save_checkpoint, weights_digest
from model.config import named_config
from model.tokenizer import ByteTokenizer


def _ttft(engine: Engine, prompt: tuple[int, ...], rid: str) -> tuple[float, list[int], int]:
    t0 = time.perf_counter()
    engine.add_request(GenerationRequest(rid, prompt, max_tokens=1))
    while True:
        for o in engine.step():
            if o.new_token_ids:
                elapsed = time.perf_counter() - t0
                engine.run_to_completion()
                return elapsed, o.new_token_ids, o.cached_tokens


def run_ttft(checkpoint: Path | None, prompt_tokens: int = 4096, repeats: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if checkpoint is None:
            cfg = named_config("bench")
            checkpoint = save_checkpoint(root / "bench", cfg, random_state_dict(cfg, seed=0))
        model = load_model(checkpoint)
        mcfg = model.cfg
        ns = Namespace(mcfg.fingerprint(), weights_digest(checkpoint), "float32", "latent", 64)
        prompt = tuple(torch.randint(0, mcfg.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist())
        pages = -(-(prompt_tokens + 16) // 16) + 8
        ecfg = EngineConfig(num_pages=pages, max_prefill_tokens=prompt_tokens)
        tok = ByteTokenizer()

        def cache(ram: int, where: str = "ssd") -> NodeCache:
            return NodeCache(CacheConfig(StoreConfig(root / where, capacity_bytes=1 << 40), ram_bytes=ram))

        def fresh_engine(c: NodeCache | None) -> Engine:
            return Engine(model, ecfg, ns, tok.decode, None, c)

        fresh_engine(None)  # warm-up allocations
        cold, ssd, ram = [], [], []
        ref = None
        warm = cache(1 << 30)
        for i in range(repeats):
            t, out, hit = _ttft(fresh_engine(None), prompt, f"cold{i}")
            cold.append(t)
            ref = ref or out
            assert out == ref and hit == 0
        _ttft(fresh_engine(warm), prompt, "fill")  # computes and persists the units
        warm.flush()
        # the SSD runs read a copy: one store per directory, and `warm` keeps its own open
        shutil.copytree(root / "ssd", root / "ssd-copy", ignore=shutil.ignore_patterns(".lock"))
        for i in range(repeats):
            ssd_only = cache(0, "ssd-copy")
            for key in ssd_only.ssd.keys():
                ssd_only.ssd.drop_page_cache(key)  # on disk, not in RAM or the page cache
            t, out, hit = _ttft(fresh_engine(ssd_only), prompt, f"ssd{i}")
            assert out == ref and hit > 0, (out, ref, hit)
            ssd.append(t)
            ssd_only.close()
            t, out, hit = _ttft(fresh_engine(warm), prompt, f"ram{i}")
            assert out == ref and hit > 0
            ram.append(t)
        cold_ms, ssd_ms, ram_ms = (min(x) * 1000 for x in (cold, ssd, ram))
        return {
            "checkpoint": str(checkpoint), "prompt_tokens": prompt_tokens, "cached_tokens": hit,
            "unit_bytes": mcfg.num_hidden_layers * 64 * mcfg.latent_dim * 4,
            "cold_ms": round(cold_ms, 1), "ssd_hit_ms": round(ssd_ms, 1), "ram_hit_ms": round(ram_ms, 1),
            "speedup_ssd": round(cold_ms / ssd_ms, 1), "speedup_ram": round(cold_ms / ram_ms, 1),
            "same_first_token": True,
        }
