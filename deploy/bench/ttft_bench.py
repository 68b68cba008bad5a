"""``tide bench ttft``: time to first token of a long prompt computed, and loaded from the prompt
cache the way a deployment loads it: this node's units (in its agent's RAM tier, on its SSD) read
from the store's files, another node's through its agent over gRPC, with the directory a
deployment uses (a local redis-server when one is installed) and units sealed under a cluster
secret as ``tide up`` seals them. Medians of ``repeats`` runs with their range.

Beside each TTFT: the load alone (``load``: the cache's own load of the prompt's units, timed
apart from the engine) as GB/s and tokens/s, against the prefill tokens/s measured here; and the
same loads for DeepSeek-V3-sized units (61 layers x 576 bf16 values: ~70 KB of KV per token, a
4K prompt ~288 MB), against the prefill rate DeepSeek reports per H800 node and against this
machine's disk (fio, O_DIRECT, the unit as block) and loopback TCP, so the figures say where
loading beats recomputing and how near the load runs to the hardware; the same prompt's KV handed
off from a prefill replica to a decode replica (P/D: ``pd_handoff_gb_per_s``, plain and sealed).
``local_agent_ssd_layered``: the local SSD hit with its prefix handed over layer by layer while the
suffix computes (``EngineConfig.layered_loads``; the other paths load whole, the CPU's default).
``hit_breakdown``: where a local SSD hit's time goes besides its load and its suffix's compute.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachedir.agent.client import AgentClient
from cachedir.agent.cluster_cache import ClusterCache
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import ServerConfig
from cachedir.directory import open_directory
from cachedir.hashing import RESUME_TOKEN, Namespace, chain_keys, resume_key
from cachedir.node_cache import CacheConfig
from cachedir.store import StoreConfig
from cachedir.unit import Unit
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from deploy.bench.hit_breakdown import Spans, hit_breakdown
from deploy.bench.machine import machine
from deploy.bench.model_bench import BENCH_CONFIGS
from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import named_config
from model.kv_sizes import PUBLISHED, kv_sizes
from model.tokenizer import ByteTokenizer
from model.weights_id import weights_digest

__all__ = ["run_ttft"]

UNIT_TOKENS = 64
SECRET = b"bench-cluster-secret-0123456789ab"  # units sealed as a deployment seals them
LAYERED = "local_agent_ssd_layered"  # the local SSD hit with its prefix handed over layer by layer
V3_LAYERS, V3_DIM = 61, 576  # DeepSeek-V3's latent KV per token and layer (kv_lora_rank 512 + rope 64), bf16
H800_PREFILL_TOKENS_PER_S = 73_700  # per node, DeepSeek's published day (ARCHITECTURE.md)


def _ttft(engine: Engine, prompt: tuple[int, ...], rid: str) -> tuple[float, list[int], int]:
    t0 = time.perf_counter()
    engine.add_request(GenerationRequest(rid, prompt, max_tokens=1))
    while True:
        for o in engine.step():
            if o.new_token_ids:
                elapsed = time.perf_counter() - t0
                engine.run_to_completion()
                return elapsed, o.new_token_ids, o.cached_tokens


def _median(xs: list[float], scale: float = 1000.0) -> dict[str, Any]:
    return {"median": round(statistics.median(xs) * scale, 2), "range": [round(min(xs) * scale, 2),
                                                                       round(max(xs) * scale, 2)]}


class _Node:
    """A node's cache agent (real gRPC on loopback) and the engine's view of the cluster's cache."""

    def __init__(self, root: Path, name: str, directory_url: str, namespace: str, ram_bytes: int) -> None:
        self.directory = open_directory(directory_url, namespace, timeout_s=5.0)
        self.agent = NodeAgent(AgentConfig(
            name, CacheConfig(StoreConfig(root / name, 1 << 40, fsync=False), ram_bytes=ram_bytes),
            ServerConfig(host="127.0.0.1"), heartbeat_ttl_s=3600, sync_every_s=3600, replication=None),
            self.directory)
        self.cache = ClusterCache(name, AgentClient(self.agent.address), self.directory, AgentClient, secret=SECRET,
                                  staging_bytes=512 << 20)

    def publish(self) -> None:
        self.cache.flush()
        self.agent.cache.flush()
        self.agent.sync_once()

    def drop_page_cache(self) -> None:
        """Its units on disk only: not in the page cache (nor in a RAM tier: it has none)."""
        for key in self.agent.cache.ssd.keys():
            self.agent.cache.ssd.drop_page_cache(key)

    def close(self) -> None:
        self.cache.close()
        self.agent.close()
        self.directory.close()


def _timed_load(cache: ClusterCache, units: list[Unit], before: Callable[[], None],
                tokens: list[tuple[int, ...]] | None = None) -> float:
    """Seconds the cache takes to look up and load ``units`` (each verified against ``tokens``,
    default their own: a sealed unit as stored withholds them), after ``before``."""
    keys = [u.key for u in units]
    before()
    t0 = time.perf_counter()
    cache.lookup(keys)
    loaded = cache.load_async(keys, units[0].namespace, tokens or [u.token_ids for u in units]).result(timeout=600)
    elapsed = time.perf_counter() - t0
    assert all(x is not None for x in loaded), "a unit failed to load"
    return elapsed


def _load_figures(seconds: list[float], nbytes: int, tokens: int) -> dict[str, Any]:
    t = statistics.median(seconds)
    return {"ms": _median(seconds), "gb_per_s": round(nbytes / t / 1e9, 3), "tokens_per_s": round(tokens / t, 1)}


def _loopback_tcp_gb_per_s(nbytes: int = 512 << 20) -> float:
    """Raw TCP over loopback (``sendall`` and ``recv_into`` of 4 MiB buffers): the ceiling of a
    load from another node's agent on this machine."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    chunk = memoryview(bytearray(4 << 20))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            for start in range(0, nbytes, len(chunk)):
                conn.sendall(chunk[: min(len(chunk), nbytes - start)])

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buf, got = memoryview(bytearray(4 << 20)), 0
    with socket.create_connection(server.getsockname()) as conn:
        t0 = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        took = time.perf_counter() - t0
    sender.join(30)
    server.close()
    return got / took / 1e9


def _handoff_gb_per_s(tokens: int, seal: bool, repeats: int) -> float:
    """A DeepSeek-V3-sized prompt's KV (bf16) handed off from a prefill replica's outbox to a
    decode replica (``cluster.kv_transfer``: TCP over loopback here), the median of ``repeats``."""
    from cluster.kv_transfer import KVOutbox, fetch_kv

    kv = torch.zeros((V3_LAYERS, tokens, V3_DIM), dtype=torch.bfloat16)
    box, rates = KVOutbox("127.0.0.1", seal=seal), []
    try:
        fetch_kv(box.put(kv))  # untimed: a replica that handed off before (its memory mapped)
        for _ in range(repeats):
            ticket = box.put(kv)
            t0 = time.perf_counter()
            fetch_kv(ticket)
            rates.append(ticket.nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        box.close()
    return statistics.median(rates)


def _fio_read_gb_per_s(path: Path, nbytes: int, block: int) -> float | None:
    """The disk's O_DIRECT read rate at ``block`` (fio, as ``tide bench unit-io`` runs it); None
    without fio."""
    from deploy.bench.cache_bench import fio_raw

    if shutil.which("fio") is None:
        return None
    try:
        return fio_raw(path, nbytes, block)["read_gb_per_s"]
    finally:
        path.unlink(missing_ok=True)


def _v3_units(prompt_tokens: int) -> list[Unit]:
    ns = Namespace("deepseek-v3-sized", "bench", "bfloat16", "latent", UNIT_TOKENS)
    tokens = list(range(prompt_tokens))
    rng = np.random.default_rng(0)
    units, parent = [], ns.seed
    for i, key in enumerate(chain_keys(ns.seed, tokens, UNIT_TOKENS)):
        payload = rng.integers(0, 1 << 16, V3_LAYERS * UNIT_TOKENS * V3_DIM, dtype=np.uint16).tobytes()
        units.append(Unit(ns.seed, key, parent, tuple(tokens[i * UNIT_TOKENS : (i + 1) * UNIT_TOKENS]),
                          payload, V3_LAYERS, V3_DIM, "bfloat16"))
        parent = key
    return units


def run_ttft(checkpoint: Path | None, prompt_tokens: int = 4096 + 37, repeats: int = 5,
             v3_prompt_tokens: int = 4096, family: str = "v3") -> dict[str, Any]:
    from deploy.redis_proc import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis_server = RedisServer(root / "redis").start() if shutil.which("redis-server") else None
        url = redis_server.url if redis_server is not None else "mem://"
        nodes: list[_Node] = []
        try:
            if checkpoint is None:
                cfg = named_config(BENCH_CONFIGS[family])
                checkpoint = save_checkpoint(root / "bench", cfg, random_state_dict(cfg, seed=0))
            model = load_model(checkpoint)
            mcfg = model.cfg
            ns = Namespace(mcfg.fingerprint(), weights_digest(checkpoint), "float32", mcfg.kv_layout, UNIT_TOKENS)
            prompt = tuple(torch.randint(0, mcfg.vocab_size, (prompt_tokens,),
                                         generator=torch.Generator().manual_seed(0)).tolist())
            ecfg = EngineConfig(num_pages=-(-(prompt_tokens + 16) // 16) + 8, max_prefill_tokens=prompt_tokens)
            tok = ByteTokenizer()

            def engine(cache, layered: bool = False) -> Engine:
                return Engine(model, dataclasses.replace(ecfg, layered_loads=layered), ns, tok.decode, None, cache)

            engine(None)  # warm-up allocations
            cold, ref = [], None
            for i in range(repeats):
                t, out, hit = _ttft(engine(None), prompt, f"cold{i}")
                cold.append(t)
                ref = ref or out
                assert out == ref and hit == 0

            # node A computes the prompt; its agent keeps the units in RAM and on its SSD
            a = _Node(root, "node-a", url, "ttft-a", ram_bytes=1 << 30)
            nodes.append(a)
            _ttft(engine(a.cache), prompt, "fill")
            a.publish()
            # node C holds a copy on its SSD only; node B holds nothing and fetches from C
            shutil.copytree(root / "node-a", root / "node-c", ignore=shutil.ignore_patterns(".lock"))
            c = _Node(root, "node-c", url, "ttft-bc", ram_bytes=0)
            b = _Node(root, "node-b", url, "ttft-bc", ram_bytes=0)
            nodes += [c, b]
            c.publish()
            paths = {"local_agent_ram": (a, lambda: None), "local_agent_ssd": (c, c.drop_page_cache),
                     "remote_agent_ssd": (b, c.drop_page_cache)}
            ttft: dict[str, list[float]] = {"cold": cold, **{p: [] for p in paths}, LAYERED: []}
            cached = 0
            for i in range(repeats):
                for path, (node, before) in [*paths.items(), (LAYERED, paths["local_agent_ssd"])]:
                    before()
                    t, out, cached = _ttft(engine(node.cache, layered=path == LAYERED), prompt, f"{path}{i}")
                    assert out == ref and cached == prompt_tokens // UNIT_TOKENS * UNIT_TOKENS, (path, out, ref, cached)
                    ttft[path].append(t)

            # the loads alone, for this model's units and for DeepSeek-V3-sized ones
            keys = chain_keys(ns.seed, list(prompt), UNIT_TOKENS)
            if resume_key(ns.seed, keys[-1]) in a.agent.cache.ssd:  # the record after the last unit (V4)
                keys.append(resume_key(ns.seed, keys[-1]))
            units = [u for u in (a.agent.cache.ssd.get(k, ns.seed) for k in keys) if u is not None]
            toks = [prompt[i * UNIT_TOKENS : (i + 1) * UNIT_TOKENS] for i in range(len(units))]
            if len(units) > prompt_tokens // UNIT_TOKENS:  # the resume record's one token
                toks[-1] = (RESUME_TOKEN,)
            unit_bytes = len(bytes(units[0].payload))
            loaded_bytes = sum(len(bytes(u.payload)) for u in units)
            load = {path: _load_figures([_timed_load(node.cache, units, before, toks) for _ in range(repeats)],
                                        loaded_bytes, cached)
                    for path, (node, before) in paths.items()}
            breakdown = []  # where a local SSD hit's time goes
            for i in range(repeats):
                c.drop_page_cache()
                eng = engine(c.cache)
                spans = Spans(eng, c.cache)
                t, out, _ = _ttft(eng, prompt, f"parts{i}")
                spans.close()
                assert out == ref
                breakdown.append((t, spans.s))
            v3 = _v3_units(v3_prompt_tokens)
            c.cache.persist(v3)  # sealed, as a replica persists them
            c.publish()
            v3_bytes = sum(len(u.payload) for u in v3)
            block = -(-len(v3[0].encode()) // 4096) * 4096  # O_DIRECT: whole 4 KiB blocks, a unit each
            fio = _fio_read_gb_per_s(root / "fio.bin", min(v3_bytes, 256 << 20) // block * block, block)
            tcp = _loopback_tcp_gb_per_s()
            handoff = {("sealed" if seal else "plain"): round(_handoff_gb_per_s(v3_prompt_tokens, seal, repeats), 3)
                       for seal in (False, True)}
            v3_load = {path: _load_figures([_timed_load(node.cache, v3, c.drop_page_cache) for _ in range(repeats)],
                                           v3_bytes, UNIT_TOKENS * len(v3))
                       for path, node in (("local_agent_ssd", c), ("remote_agent_ssd", b))}
        finally:
            for node in nodes:
                node.close()
            if redis_server is not None:
                redis_server.kill()

    prefill = prompt_tokens / statistics.median(cold)
    v3_token_bytes = V3_LAYERS * V3_DIM * 2
    return {
        **machine(), "checkpoint": str(checkpoint), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "unit_bytes": unit_bytes, "repeats": repeats, "directory": "redis" if redis_server else "memory",
        "prefix_load": {"bytes": loaded_bytes, "bytes_per_cached_token": round(loaded_bytes / cached, 1),
                        "published_bytes_per_cached_token": {
                            name: round(kv_sizes(c).prefix_load_bytes(prompt_tokens) / cached, 1)
                            for name, c in PUBLISHED.items()}},
        "ttft_ms": {path: _median(ts) for path, ts in ttft.items()},
        "speedup": {path: round(statistics.median(cold) / statistics.median(ts), 2)
                    for path, ts in ttft.items() if path != "cold"},
        # the local SSD hit with its prefix handed over layer by layer, over the whole-load one
        "layered_vs_whole": round(statistics.median(ttft[LAYERED]) / statistics.median(ttft["local_agent_ssd"]), 3),
        "prefill_tokens_per_s": round(prefill, 1),
        "load": {path: {**f, "beats_prefill": f["tokens_per_s"] > prefill} for path, f in load.items()},
        "deepseek_v3": {
            "kv_bytes_per_token": v3_token_bytes, "prompt_tokens": v3_prompt_tokens, "prompt_bytes": v3_bytes,
            "h800_node_prefill_tokens_per_s": H800_PREFILL_TOKENS_PER_S,
            # loading a prompt beats recomputing it, at DeepSeek's prefill rate, above this bandwidth
            "break_even_gb_per_s": round(v3_token_bytes * H800_PREFILL_TOKENS_PER_S / 1e9, 2),
            "load": {path: {**f, "beats_h800_prefill": f["tokens_per_s"] > H800_PREFILL_TOKENS_PER_S}
                     for path, f in v3_load.items()},
            # the hardware under the loads, measured in this run: a local load reads the disk, a
            # remote one the disk and the network
            "fio_read_gb_per_s": fio, "loopback_tcp_gb_per_s": round(tcp, 3),
            "fraction_of_hardware": {
                "local_agent_ssd": round(v3_load["local_agent_ssd"]["gb_per_s"] / fio, 3) if fio else None,
                "remote_agent_ssd": round(v3_load["remote_agent_ssd"]["gb_per_s"] / min(fio or tcp, tcp), 3)},
            # the P/D handoff of this prompt's KV from a prefill replica's outbox (plain, and sealed
            # as a cluster with a cache secret sends it) against loopback TCP measured above
            "pd_handoff_gb_per_s": handoff,
            "pd_handoff_fraction_of_tcp": {k: round(v / tcp, 3) for k, v in handoff.items()},
        },
        "hit_breakdown": hit_breakdown(breakdown),
    }
