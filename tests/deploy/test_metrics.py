"""The ingress's Prometheus series: names, the model label, one series per replica."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deploy.metrics import IngressMetrics


def _samples(m: IngressMetrics) -> list:
    return [s for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples]


def _report(node: str, running: int, waiting: int, kv: float) -> dict:
    return {"node_id": node, "stats": {"running": running, "waiting": waiting, "kv_usage": kv}}


def test_each_replica_is_a_series_and_a_replica_that_stopped_reporting_is_none():
    m = IngressMetrics("deepseek")
    m.replicas({"SERVE_REPLICA::tideserve#LLMServer#a1": _report("n" * 20, 3, 1, 0.25),
                "SERVE_REPLICA::tideserve#LLMServer#b2": _report("m" * 20, 0, 0, 0.0),
                "SERVE_REPLICA::tideserve#LLMDecode#c3": _report("m" * 20, 7, 0, 0.5)})
    running = {(s.labels["deployment"], s.labels["replica"]): s.value for s in _samples(m)
               if s.name == "tide:num_requests_running"}
    assert running == {("LLMServer", "a1"): 3, ("LLMServer", "b2"): 0, ("LLMDecode", "c3"): 7}
    kv = {s.labels["replica"]: s.value for s in _samples(m) if s.name == "tide:kv_cache_usage_perc"}
    assert kv == {"a1": 0.25, "b2": 0.0, "c3": 0.5}
    assert {s.labels["node"] for s in _samples(m) if s.name == "tide:num_requests_waiting"} == {"n" * 12, "m" * 12}
    m.replicas({"SERVE_REPLICA::tideserve#LLMServer#a1": _report("n" * 20, 1, 0, 0.1)})
    assert [s.labels["replica"] for s in _samples(m) if s.name == "tide:num_requests_running"] == ["a1"]


def test_every_series_carries_the_model_and_the_vllm_names():
    m = IngressMetrics("deepseek")
    m.prompt_tokens("compute").inc(5)
    m.generation_tokens.inc(2)
    m.requests("ok").inc()
    m.ttft.observe(0.1)
    m.itl.observe(0.01)
    m.e2e.observe(1.0)
    m.tier_bytes("node", "ssd").set(10)
    samples = _samples(m)
    assert samples and all(s.labels["model_name"] == "deepseek" for s in samples)
    names = {s.name for s in samples}
    for name in ("tide:prompt_tokens_total", "tide:generation_tokens_total", "tide:request_success_total",
                 "tide:time_to_first_token_seconds_count", "tide:inter_token_latency_seconds_count",
                 "tide:e2e_request_latency_seconds_count", "tide:cache_bytes", "tide:requests_in_flight"):
        assert name in names, name


def test_nodes_by_role_count_every_alive_node_once():
    m = IngressMetrics("deepseek")
    m.node_roles(["a", "b", "c", "d"], {"b": "lent", "c": "draining", "gone": "lent"})
    nodes = {s.labels["role"]: s.value for s in _samples(m) if s.name == "tide:nodes"}
    assert nodes == {"serving": 2, "draining": 1, "migrate": 0, "lent": 1}


def test_prompt_tokens_count_by_source_and_cache_misses_by_reason():
    """A 300-token prompt has 4 whole units before its last token: one came from the SSD, one
    was computed though the plan loaded it (stale), one because the router declined the load;
    the last one no live node was listed for (never seen). Then one where the engine counted three
    units as evicted (the directory remembered the first unlisted one as dropped) and the fourth
    as never seen."""
    from cluster.request import TokenSources

    m = IngressMetrics("deepseek")
    m.count_prompt(300, TokenSources(compute=236, ssd=64, stale=64, declined=64, listed=192, planned=128))
    m.count_prompt(300, TokenSources(compute=300, evicted=192))  # no live holder; the first unit was dropped
    m.count_prompt(64, TokenSources(compute=64))  # no whole unit before the last token: nothing to miss
    by = {(s.name, s.labels.get("source") or s.labels.get("reason")): s.value for s in _samples(m)
          if s.name in ("tide:prompt_tokens_total", "tide:prompt_cache_misses_total")}
    assert by[("tide:prompt_tokens_total", "compute")] == 236 + 64 + 300 and by[("tide:prompt_tokens_total", "ssd")] == 64
    assert by[("tide:prompt_cache_misses_total", "stale")] == 64
    assert by[("tide:prompt_cache_misses_total", "declined")] == 64
    assert by[("tide:prompt_cache_misses_total", "evicted")] == 192
    assert by[("tide:prompt_cache_misses_total", "unseen")] == 64 + 64
    totals = {s.name: s.value for s in _samples(m) if s.name.startswith("tide:prompt_cache_") and s.name.endswith("tokens_total")}
    assert totals == {"tide:prompt_cache_listed_tokens_total": 192, "tide:prompt_cache_planned_tokens_total": 128}
    assert TokenSources(compute=236, ssd=64, stale=64, declined=64, listed=192, planned=128).accounting(300) == {
        "cacheable_tokens": 256, "listed_tokens": 192, "planned_tokens": 128, "delivered_tokens": 64,
        "missed_tokens": {"stale": 64, "declined": 64, "evicted": 0, "unseen": 64}}


def test_the_nights_and_the_training_job():
    m = IngressMetrics("deepseek")
    m.tidal({"nights": 2, "migrated": 1, "last_drain_s": 3.5}, "raysubmit_1")
    got = {s.name: s.value for s in _samples(m) if s.name in (
        "tide:nights", "tide:nights_migrated", "tide:night_drain_seconds", "tide:training_job_active")}
    assert got == {"tide:nights": 2, "tide:nights_migrated": 1, "tide:night_drain_seconds": 3.5,
                   "tide:training_job_active": 1}
    m.tidal({"nights": 2, "migrated": 1, "last_drain_s": 3.5}, None)
    assert [s.value for s in _samples(m) if s.name == "tide:training_job_active"] == [0]


def test_the_expert_placement_and_its_imbalance_on_the_measured_load():
    import torch

    from deploy.ep_admin import placement_imbalance

    info = {"version": 3, "num_shards": 2, "rebalances": 1, "moved_slots": 4, "phy2log": [[0, 1, 2, 3]]}
    load = torch.tensor([[3.0, 1.0, 1.0, 1.0]])  # shard 0 holds experts 0 and 1: 4 of the 6
    assert placement_imbalance(info, load) == round(4 / 3, 4)
    assert placement_imbalance(info, torch.zeros(1, 4)) is None  # nothing measured yet
    m = IngressMetrics("deepseek")
    m.expert_placement(info, placement_imbalance(info, load))
    got = {s.name: s.value for s in _samples(m) if s.name.startswith("tide:ep_")}
    assert got == {"tide:ep_placement_version": 3, "tide:ep_shards": 2, "tide:ep_rebalances": 1,
                   "tide:ep_moved_slots": 4, "tide:ep_imbalance": round(4 / 3, 4)}
