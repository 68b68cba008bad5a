"""``tide bench`` on clusters: the directory, trace replays, TTFT, the cluster, soak; ``all`` of the
CPU benchmarks."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import typer

from deploy.bench.cli_common import PLOT, check_plot, emit, family_name, plotted
from deploy.options import check_checkpoint, check_redis_url


def bench_directory(
    redis_url: str = typer.Option(None, "--redis-url", help="measure this Redis or cluster (redis+cluster://) "
                                  "only; default: a local redis-server and a local 3-primary Redis Cluster"),
    units: int = typer.Option(2000, "--units", min=1, help="chain length looked up (2,000 = 128K tokens)"),
    lookups: int = typer.Option(300, "--lookups", min=1),
    clients: int = typer.Option(16, "--clients", min=1, help="concurrent clients looking the chain up"),
    trace: Path = typer.Option(None, "--trace", help="also replay a Mooncake-format JSONL trace's lookups and "
                               "registrations"),
    trace_limit: int = typer.Option(2000, "--trace-limit", min=1, help="requests of the trace replayed"),
    trace_nodes: int = typer.Option(8, "--trace-nodes", min=1, help="nodes the replayed units are registered on"),
    cluster: bool = typer.Option(True, "--cluster/--no-cluster", help="also measure a local Redis Cluster"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """The cache directory on one Redis and on a Redis Cluster (3 primaries, a replica each),
    per store: ``chain`` (one client, a --units chain: round trips per lookup, lookups/s, p50/p99,
    registrations/s, redis_us_per_lookup: the command time a lookup costs Redis, from INFO
    commandstats over every primary; redis_cpu_us_per_lookup: its main threads' CPU, which also
    counts reading requests and writing replies, with redis_cpu_us_per_ping that floor for an empty
    round trip; redis_bytes_per_unit: memory per unit one node holds), ``concurrent`` (--clients
    threads: lookups/s and p50/p99) and, with --trace, ``trace`` (the trace's prompts looked up and
    their missed units registered in order; on the cluster cluster_imbalance: the busiest primary's
    command time over the mean)."""
    from deploy.bench.directory_bench import run_directory

    check_redis_url(redis_url)
    if trace is not None and not trace.is_file():
        raise typer.BadParameter(f"--trace {str(trace)!r} is not a file")
    emit(run_directory(redis_url, units, lookups, clients, trace, trace_limit, trace_nodes, cluster))


def bench_trace(
    trace: Path = typer.Option(..., "--trace", help="Mooncake-format JSONL trace"),
    policy: str = typer.Option("all", "--policy", help="all | deepseek | second-sight | every (all three)"),
    capacity_gb: float = typer.Option(None, "--capacity-gb", min=0.0, help="SSD capacity (default: unlimited)"),
    capacity_fraction: float = typer.Option(None, "--capacity-fraction", min=0.0, help="capacity as a share of the trace's unique unit bytes"),
    ram_gb: float = typer.Option(None, "--ram-gb", min=0.0, help="RAM tier above the SSD"),
    unit: int = typer.Option(64, "--unit", min=1, help="tokens per cache unit (must divide 512)"),
    unit_bytes: int = typer.Option(None, "--unit-bytes", min=1, help="bytes per unit (default: the bench model's)"),
    eviction: str = typer.Option("lru", "--eviction", help="lru | lfu"),
    limit: int = typer.Option(None, "--limit", min=1, help="replay only the first N requests"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Replay a trace through the real admission and eviction code; hit rate and bytes moved."""
    from cachedir.admission import POLICIES
    from deploy.bench.cache_bench import bench_unit_bytes, run_trace

    if not trace.is_file():
        raise typer.BadParameter(f"--trace {str(trace)!r} is not a file")
    if policy != "every" and policy not in POLICIES:
        raise typer.BadParameter(f"--policy {policy!r} is not one of {', '.join(POLICIES)}, every")
    if 512 % unit:
        raise typer.BadParameter(f"--unit {unit} must divide the trace's 512-token blocks")
    if eviction not in ("lru", "lfu"):
        raise typer.BadParameter(f"--eviction {eviction!r} is not one of lru, lfu")
    if capacity_gb is not None and capacity_fraction is not None:
        raise typer.BadParameter("give at most one of --capacity-gb and --capacity-fraction")
    policies = list(POLICIES) if policy == "every" else [policy]
    try:
        result = run_trace(trace, policies, capacity_gb, capacity_fraction, unit,
                           unit_bytes or bench_unit_bytes(), ram_gb, eviction, limit)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    emit(result)


def bench_ttft(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the bench config"),
    prompt_tokens: int = typer.Option(4096 + 37, "--prompt-tokens", min=65,
                                      help="prompt length (default 4,133: not a whole number of units)"),
    repeats: int = typer.Option(5, "--repeats", min=1),
    v3_prompt_tokens: int = typer.Option(4096, "--v3-prompt-tokens", min=64,
                                         help="prompt whose DeepSeek-V3-sized units are loaded"),
    family: str = typer.Option("v3", "--family", help="without --checkpoint: the bench config of v3, v3.2 or v4"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Time to first token of a long prompt (medians of --repeats, with ranges): computed, and
    loaded as a deployment loads it, through the node's cache agent over gRPC (its RAM tier; its
    SSD, page cache dropped) and through another node's agent; every run on a fresh engine with
    the same first token. Beside it the loads alone (GB/s, tokens/s, and whether they beat the
    prefill tokens/s measured here), and loads of DeepSeek-V3-sized units (~70 KB of KV per
    token) against DeepSeek's prefill rate per H800 node. ``prefix_load``: the bytes the hit
    loaded per cached token, and the same for the published V3, V3.2, V4-Flash and V4-Pro."""
    from deploy.bench.ttft_bench import run_ttft

    check_checkpoint(checkpoint)
    emit(run_ttft(checkpoint, prompt_tokens, repeats, v3_prompt_tokens, family=family_name(family)))


def bench_cluster(
    trace: Path = typer.Option(..., "--trace", help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)"),
    nodes: int = typer.Option(3, "--nodes", min=2, max=8, help="simulated Ray nodes (one replica and one cache agent each)"),
    requests: int = typer.Option(1500, "--requests", min=1, help="replay the first N trace records (the whole 3,993-request shared trace takes ~13 min here)"),
    skip: int = typer.Option(0, "--skip", min=0, help="pass over the trace's first N records: replay the N+1th on (a part of the trace the figures were not tuned on)"),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="closed-loop HTTP clients (without --rate)"),
    rate: float = typer.Option(None, "--rate",
                               help="requests a second in an open loop: each sent at the trace's timestamp, the timestamps "
                                    "scaled to this mean rate, whatever is in flight; TTFT counts from the arrival "
                                    "(default: --concurrency clients in a closed loop)"),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", min=1,
                                     help="sequences each replica runs at once (default: --concurrency, at least 4; "
                                          "the app's own default is 16)"),
    block_tokens: int = typer.Option(8, "--block-tokens", min=1, max=512, help="tokens per 512-token trace block (scale factor = 512 / this)"),
    max_prompt_tokens: int = typer.Option(2048, "--max-prompt-tokens", min=1),
    max_tokens: int = typer.Option(4, "--max-tokens", min=1, help="cap on each request's (scaled) output"),
    modes: str = typer.Option("shared,prefix_affinity,per_node,round_robin", "--modes",
                              help="comma-separated: shared, prefix_affinity, prefix_affinity_sglang, per_node, round_robin"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="runs of every mode, taking turns (medians count)"),
    scenario: str = typer.Option("trace", "--scenario",
                                 help="comma-separated; several are replayed in turn on one simulated cluster, "
                                      "their outputs under 'scenarios'. trace: as it is; skew: 60% of the requests get one of 3 hot prefixes (4,096 trace tokens, scaled) in front of their prompt; "
                                      "scale: a node lent a third of the way in and back two thirds in; failure: a "
                                      "node removed half way; pressure: each node's SSD holds a quarter of the "
                                      "working set, no RAM tier, no pages kept in a replica's pool; night: the "
                                      "night's and the morning's hits with no node lent, one lent and removed, and "
                                      "one lent with its hot units kept and the morning's node warmed (the "
                                      "shared directory only; --modes is ignored)"),
    pace: str = typer.Option(None, "--pace", metavar="PASS_MS,TOKEN_MS,ROW_MS",
                             help="emulate a device per replica: each forward pass lasts at least PASS_MS + "
                                  "TOKEN_MS per prompt token + ROW_MS per decode row (the rest slept), so "
                                  "the simulated nodes, which share this machine's cores, each have capacity "
                                  "of their own, as replicas on separate GPUs do (default: the CPU's own time)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    plot: Path = PLOT,
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Replay a trace against a simulated multi-node cluster: the shared cache directory with the
    cache-aware router; prefix affinity without a directory (consistent hashing of the first 256
    tokens, the baseline SGLang's and Ray Serve's routers offer; bounded load, or with
    prefix_affinity_sglang balanced only as far as SGLang's router by default); per-node caches only; round-robin
    placement. Every mode --repeats times, taking turns, on empty caches each run: medians with
    ranges of token_hit_rate (overall and by source: ram, local_ssd, remote), ttft_p50_ms and
    ttft_p99_ms, busiest_replica_share, every run's figures with its TTFT by where the prompt's KV
    came from and what each replica did, errors; with scale and failure, the same for each window
    after an event (windows); shared_vs_<mode>: beats/loses by a margin (the runs' ranges apart),
    no_margin, single_run."""
    from deploy.bench.cluster_bench import MODES, SCENARIOS, run_cluster_bench
    from deploy.bench.fleet_events import run_scenarios

    scenarios = tuple(s.strip() for s in scenario.split(",") if s.strip())
    for name in scenarios or ("",):
        if name not in (*SCENARIOS, "night"):
            raise typer.BadParameter(f"--scenario {name!r}: choose from {', '.join(SCENARIOS)}, night")
    if len(set(scenarios)) < len(scenarios):
        raise typer.BadParameter(f"--scenario {scenario!r}: a scenario named twice")
    if rate is not None and not rate > 0:
        raise typer.BadParameter(f"--rate {rate}: requests a second must be positive")
    paced = parse_pace(pace) if pace is not None else None

    if not trace.is_file():
        raise typer.BadParameter(f"--trace {str(trace)!r} is not a file")
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in chosen if m not in MODES]
    if bad or not chosen:
        raise typer.BadParameter(f"--modes {modes!r}: unknown mode {bad[0] if bad else ''!r}; choose from {', '.join(MODES)}")
    check_checkpoint(checkpoint)
    check_plot(plot)
    if "pressure" in scenarios:
        from deploy.bench.cluster_bench import unit_bytes

        try:
            unit_bytes(checkpoint)
        except ValueError as e:
            raise typer.BadParameter(f"--scenario pressure: {e}") from None
    try:
        from cachedir.trace import read_trace

        records = sum(1 for _ in read_trace(trace, limit=skip + 1))  # (a malformed line raises)
    except ValueError as e:
        raise typer.BadParameter(f"--trace: {e}") from None
    if records <= skip:
        raise typer.BadParameter(f"--skip {skip}: the trace has {records} records")

    from deploy.term import progress

    with contextlib.redirect_stdout(sys.stderr), progress("replaying", None) as bar:  # Ray's shutdown
        # messages must not precede the JSON; the bar shows on a terminal only (stderr)
        common = dict(requests=requests, concurrency=concurrency, block_tokens=block_tokens,
                      max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens, checkpoint=checkpoint,
                      repeats=repeats, skip=skip, rate=rate, max_num_seqs=max_num_seqs, pace=paced)
        if len(scenarios) > 1:
            result = run_scenarios(trace, scenarios, nodes, modes=chosen, progress=bar, **common)
        elif scenarios == ("night",):
            from deploy.bench.night_bench import run_night_bench

            result = run_night_bench(trace, nodes, **common)
        else:
            result = run_cluster_bench(trace, nodes, modes=chosen, progress=bar, scenario=scenarios[0], **common)
    emit(plotted("cluster", result, plot))


def parse_pace(text: str) -> dict[str, float]:
    """``--pace PASS_MS,TOKEN_MS,ROW_MS`` as ``AppArgs.pace`` (a CLI error names a bad value)."""
    import dataclasses

    from cluster.engine_config import PassPace

    parts = text.split(",")
    if len(parts) != 3:
        raise typer.BadParameter(f"--pace {text!r}: give three numbers of ms, PASS_MS,TOKEN_MS,ROW_MS (e.g. 5,1,0.5)")
    try:
        return dataclasses.asdict(PassPace(*map(float, parts)))
    except ValueError as e:
        raise typer.BadParameter(f"--pace {text!r}: {e}") from None


def bench_soak(
    minutes: float = typer.Option(10.0, "--minutes", min=0.1, help="how long the load runs"),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="closed-loop HTTP clients"),
    nodes: int = typer.Option(2, "--nodes", min=2, max=8, help="simulated Ray nodes (one replica and one cache agent each)"),
    fault_every_s: float = typer.Option(60.0, "--fault-every-s", min=5.0, help="seconds between faults (Redis restart, then agent kill, in turn)"),
    grace_s: float = typer.Option(5.0, "--grace-s", min=0.0, help="a fault's announced window lasts until it recovered plus this"),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """A bounded soak through HTTP (shared and unique prefixes) against a simulated multi-node
    cluster while Redis is restarted empty and cache agents are killed, in turn: requests, errors
    (outside the faults' 503 windows), wrong_outputs (against the model alone), rss_growth_mb."""
    from deploy.bench.soak_bench import run_soak

    check_checkpoint(checkpoint)

    from deploy.term import progress

    with contextlib.redirect_stdout(sys.stderr), progress("soak (seconds)", minutes * 60) as bar:
        result = run_soak(minutes, concurrency, nodes, fault_every_s, grace_s, max_tokens, checkpoint, progress=bar)
    emit(result)


def bench_all(
    budget_min: float = typer.Option(60.0, "--budget-min", min=0.0, help="start no benchmark after this many minutes"),
    only: str = typer.Option(None, "--only", help="comma-separated benchmarks, in this order (default: every CPU one)"),
    trace: Path = typer.Option(None, "--trace", help="also replay this Mooncake-format trace (every admission policy, capacity half its units)"),
    out: Path = typer.Option(None, "--out", help="also write the report to this file"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """The CPU benchmarks one after another with their defaults (eplb, structured, directory,
    unit-io, engine, ttft, model, ep, stream, serve; trace with --trace), cheapest first, as one report;
    those that would start after the budget is spent are listed as skipped."""
    from deploy.bench.all_bench import BENCHMARKS, run_all

    known = list(BENCHMARKS) + (["trace"] if trace is not None else [])
    names = [n.strip() for n in only.split(",") if n.strip()] if only else known
    for name in names:
        if name not in known:
            hint = " (give --trace for trace)" if name == "trace" else ""
            raise typer.BadParameter(f"--only {name!r} is not one of {', '.join(known)}{hint}")
    if trace is not None and not trace.is_file():
        raise typer.BadParameter(f"--trace {str(trace)!r} is not a file")
    if out is not None and not out.parent.is_dir():
        raise typer.BadParameter(f"--out {str(out)!r}: its directory does not exist")
    with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
        report = run_all(names, budget_min * 60, trace)
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    emit(report)
