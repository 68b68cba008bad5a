"""``tide bench ep``: decode with experts on shards across simulated nodes vs one process.

Starts a ``ray.cluster_utils.Cluster`` of N nodes (one CPU each), one expert shard per node and
an attention replica on node 0 that holds attention, dense layers, shared experts and gates; the
same actor also holds the whole model (``single_process``), so all three cases run in the same
cluster, on the same node, taking turns: each of ``repeats`` runs times every case once, in an
order that rotates, and each figure is the median over runs (of each run's median step) with its
range. The KV pool holds random latents (decode cost depends on the context length, not its
values). ``overlap_speedup`` = tokens/s with two micro-batches over tokens/s without;
``blocked_hidden_fraction`` = 1 - (time blocked on expert rounds with two micro-batches) / (time
blocked without); ``dispatch_hidden_fraction`` is that share only where the overlap made decode
faster (``overlap_speedup`` > 1), else 0: less time blocked that a slower step pays for does
not count.

``wire`` gives the bytes one round (one MoE layer of one micro-batch) and one decode step (every
MoE layer) send to the shards and back, with a BF16 model's rows on the wire and with FP8
dispatch and BF16 combine (``cluster.ep.Wire``), at the benchmark config's dimensions and at
DeepSeek-V3's; rows are counted once per token and shard, as dispatched.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from cluster.ep import EPExecutor, Round, Wire
from cluster.eplb import EplbConfig, plan
from model.checkpoint import load_model, random_state_dict, save_checkpoint
from model.config import named_config
from model.model import DeepseekModel


def _time_decode(model: DeepseekModel, batch: int, context: int, steps: int, micro_batches: int,
                 blocked=lambda: 0.0) -> dict[str, float]:
    pages_per_seq = -(-(context + steps + 1) // 16)
    pool = model.new_pool(batch * pages_per_seq, 16)
    pool.data.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    tables = torch.arange(batch * pages_per_seq).view(batch, pages_per_seq)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(1))
    times, waits = [], []
    for step in range(steps + 1):  # the first step warms up
        positions = torch.full((batch,), context + step)
        w0, t0 = blocked(), time.perf_counter()
        model.decode(tokens, pool, tables, positions, micro_batches=micro_batches)
        if step:
            times.append(time.perf_counter() - t0)
            waits.append(blocked() - w0)
    step_s = statistics.median(times)
    return {"tokens_per_s": round(batch / step_s, 1), "step_ms": round(step_s * 1e3, 2),
            "blocked_on_experts_ms": round(statistics.median(waits) * 1e3, 2)}


# DeepSeek-V3's expert-parallel dimensions: hidden size, routed experts, experts per token, MoE layers
V3_DIMS = {"hidden": 7168, "experts": 256, "top_k": 8, "moe_layers": 58}


class _CountingTransport:
    """Moves nothing: returns a combine payload of the round's shape (for byte counts)."""

    def __init__(self, wire: Wire, dtype: torch.dtype) -> None:
        self.out_dtype = wire.out_dtype(dtype)

    def dispatch_combine(self, layer: int, version: int, rnd: Round) -> torch.Tensor:
        return torch.zeros(rnd.rows.shape[0], rnd.rows.shape[1], dtype=self.out_dtype)


def wire_bytes(hidden: int, experts: int, top_k: int, moe_layers: int, shards: int, batch: int) -> dict[str, Any]:
    """Bytes per round and per decode step of ``batch`` tokens routed to ``top_k`` of ``experts``
    uniformly spread over ``shards``, for a BF16 model's rows and for FP8 dispatch."""
    slots = experts + (-experts) % shards
    placement = plan(torch.ones(1, experts, dtype=torch.float64), EplbConfig(slots, 1, 1, shards, "global"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(batch, experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(batch, top_k, generator=gen)
    out: dict[str, Any] = {"batch": batch, "hidden": hidden, "experts": experts, "top_k": top_k, "shards": shards,
                           "moe_layers": moe_layers}
    for name, wire in (("bf16", Wire()), ("fp8", Wire("fp8", "bf16"))):
        ex = EPExecutor(placement, [0], _CountingTransport(wire, torch.bfloat16), wire=wire)
        ex(0, x, ids, weights)
        st = ex.stats
        out[name] = {"rows": st["rows"], "pairs": st["pairs"], "dispatch_bytes_per_round": st["dispatch_bytes"],
                     "combine_bytes_per_round": st["combine_bytes"],
                     "bytes_per_step": (st["dispatch_bytes"] + st["combine_bytes"]) * moe_layers}
    out["fp8_dispatch_over_bf16"] = round(out["fp8"]["dispatch_bytes_per_round"] / out["bf16"]["dispatch_bytes_per_round"], 3)
    return out


def run_wire_bench(nodes: int = 3, batch: int = 32, config: str = "bench") -> dict[str, Any]:
    cfg = named_config(config)
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace)
    return {config: wire_bytes(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, moe_layers, nodes, batch),
            "deepseek_v3": wire_bytes(**V3_DIMS, shards=nodes, batch=batch)}


class EPBenchReplica:
    """The benchmark's replica (a Ray actor on node 0): attention with experts on the shards, and
    the whole model in this process (the single-process baseline)."""

    def __init__(self, checkpoint: str, control) -> None:
        from actors.ep_group import EPGroup

        self.single = load_model(checkpoint)
        self.model = load_model(checkpoint, routed_experts=False)
        self.group = EPGroup(control, "bench", self.model.cfg.hidden_size, self.model.dtype)
        self.executor = self.group.start()
        self.model.set_expert_executor(self.executor)

    def time_decode(self, case: str, batch: int, context: int, steps: int) -> dict[str, float]:
        """``case``: single (one process), off (EP, one micro-batch) or on (EP, two)."""
        if case == "single":
            return _time_decode(self.single, batch, context, steps, 1)
        return _time_decode(self.model, batch, context, steps, 2 if case == "on" else 1,
                            lambda: self.executor.stats["wait_s"])


CASES = ("single", "off", "on")


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over runs and the tokens/s range (slowest run, fastest run)."""
    rates = [r["tokens_per_s"] for r in runs]
    return {"tokens_per_s": round(statistics.median(rates), 1), "tokens_per_s_range": [min(rates), max(rates)],
            "step_ms": round(statistics.median(r["step_ms"] for r in runs), 2),
            "blocked_on_experts_ms": round(statistics.median(r["blocked_on_experts_ms"] for r in runs), 2)}


def run_ep_bench(nodes: int = 3, batch: int = 32, context: int = 256, steps: int = 8,
                 config: str = "bench", repeats: int = 3) -> dict[str, Any]:
    import ray

    from actors.ep_control import ep_control_actor
    from actors.ep_group import expert_shard_actor
    from deploy.sim_cluster import SimulatedCluster

    cfg = named_config(config)
    slots = cfg.n_routed_experts + (-cfg.n_routed_experts) % nodes + nodes  # one redundant copy per shard
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(tmp, cfg, random_state_dict(cfg, seed=0))
        cluster = SimulatedCluster(num_cpus=1, resources={"node0": 1}, include_dashboard=False)
        try:
            for i in range(1, nodes):
                cluster.add_node(num_cpus=1, resources={f"node{i}": 1})
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            shards = [expert_shard_actor(num_cpus=0, resources={f"node{i}": 0.01}).remote() for i in range(nodes)]
            control = ep_control_actor(num_cpus=0, resources={"node0": 0.01}).remote(str(ckpt), shards, slots, nodes)
            replica = ray.remote(num_cpus=0, resources={"node0": 0.01})(EPBenchReplica).remote(str(ckpt), control)
            for r in range(repeats):
                for case in CASES[r % 3:] + CASES[: r % 3]:  # the order rotates: drift hits every case alike
                    runs[case].append(ray.get(replica.time_decode.remote(case, batch, context, steps), timeout=1800))
        finally:
            ray.shutdown()
            cluster.shutdown()
    single, off, on = (_summary(runs[c]) for c in CASES)
    blocked = 1.0 - on["blocked_on_experts_ms"] / off["blocked_on_experts_ms"] if off["blocked_on_experts_ms"] else 0.0
    blocked = round(max(0.0, min(1.0, blocked)), 3)
    speedup = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
    return {
        "config": config, "nodes": nodes, "shards": nodes, "slots": slots, "batch": batch, "context": context,
        "steps": steps, "repeats": repeats, "statistic": "median over repeats of each run's median step",
        "single_process": single, "ep_overlap_off": off, "ep_overlap_on": on,
        "overlap_speedup": speedup, "blocked_hidden_fraction": blocked,
        "dispatch_hidden_fraction": blocked if speedup > 1.0 else 0.0,
        "wire": run_wire_bench(nodes, batch, config),
        "machine": platform.machine(), "torch": torch.__version__,
        "note": "simulated nodes share this machine's cores: shards and attention compete for CPU",
    }
