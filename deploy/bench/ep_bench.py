"""``tide bench ep``: decode with experts on shards across simulated nodes vs one process.

Starts a ``ray.cluster_utils.Cluster`` of N nodes (one CPU each), one expert shard per node and
an attention replica on node 0 that holds attention, dense layers, shared experts and gates. The
KV pool holds random latents (decode cost depends on the context length, not its values). Each
figure is the median of the timed steps. ``dispatch_hidden_fraction`` = 1 - (time blocked on
expert rounds with two micro-batches) / (time blocked without): the share of the dispatch and
combine time that attention of the other micro-batch hid.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

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


class EPBenchReplica:
    """The attention replica of the benchmark (runs on node 0 as a Ray actor)."""

    def __init__(self, checkpoint: str, control) -> None:
        from actors.ep_group import EPGroup

        self.model = load_model(checkpoint, routed_experts=False)
        self.group = EPGroup(control, "bench", self.model.cfg.hidden_size, self.model.dtype)
        self.executor = self.group.start()
        self.model.set_expert_executor(self.executor)

    def time_decode(self, batch: int, context: int, steps: int, micro_batches: int) -> dict[str, float]:
        return _time_decode(self.model, batch, context, steps, micro_batches, lambda: self.executor.stats["wait_s"])


def run_ep_bench(nodes: int = 3, batch: int = 32, context: int = 256, steps: int = 8,
                 config: str = "bench") -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from actors.ep_control import ep_control_actor
    from actors.ep_group import expert_shard_actor

    cfg = named_config(config)
    slots = cfg.n_routed_experts + (-cfg.n_routed_experts) % nodes + nodes  # one redundant copy per shard
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(tmp, cfg, random_state_dict(cfg, seed=0))
        single = _time_decode(load_model(ckpt), batch, context, steps, 1)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node0": 1}})
        try:
            for i in range(1, nodes):
                cluster.add_node(num_cpus=1, resources={f"node{i}": 1})
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            shards = [expert_shard_actor(num_cpus=0, resources={f"node{i}": 0.01}).remote() for i in range(nodes)]
            control = ep_control_actor(num_cpus=0, resources={"node0": 0.01}).remote(str(ckpt), shards, slots, nodes)
            replica = ray.remote(num_cpus=0, resources={"node0": 0.01})(EPBenchReplica).remote(str(ckpt), control)
            off = ray.get(replica.time_decode.remote(batch, context, steps, 1), timeout=1800)
            on = ray.get(replica.time_decode.remote(batch, context, steps, 2), timeout=1800)
        finally:
            ray.shutdown()
            cluster.shutdown()
    hidden = 1.0 - on["blocked_on_experts_ms"] / off["blocked_on_experts_ms"] if off["blocked_on_experts_ms"] else 0.0
    return {
        "config": config, "nodes": nodes, "shards": nodes, "slots": slots, "batch": batch, "context": context,
        "steps": steps, "single_process": single, "ep_overlap_off": off, "ep_overlap_on": on,
        "dispatch_hidden_fraction": round(max(0.0, min(1.0, hidden)), 3),
        "note": "simulated nodes share this machine's cores: shards and attention compete for CPU",
    }
