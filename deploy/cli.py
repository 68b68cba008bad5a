"""``tide``: the tideserve command line.

Every command validates its arguments at the edge and names the bad value; ``--json`` commands
print exactly one JSON object on stdout.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from deploy.batch_cli import batch_app
from deploy.bench.cli import bench_app
from deploy.cache_cli import cache_app
from deploy.eplb_cli import eplb_app
from deploy.generate_cli import generate
from deploy.logs_cli import logs
from deploy.options import check_checkpoint, check_device, check_dtype, check_redis_url
from deploy.scale_cli import drain, scale
from deploy.schedule_cli import schedule_app
from deploy.stats_cli import stats
from deploy.status_cli import status
from deploy.train_cli import train_app

app = typer.Typer(
    help="tideserve: serve DeepSeek-style models (MLA + MoE) on Ray with a disk prompt cache.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("generate")(generate)
app.add_typer(bench_app, name="bench")
app.add_typer(eplb_app, name="eplb")
app.add_typer(cache_app, name="cache")
app.add_typer(batch_app, name="batch")
app.command("stats")(stats)
app.add_typer(train_app, name="train")
app.command("scale")(scale)
app.command("drain")(drain)
app.command("status")(status)
app.command("logs")(logs)
app.add_typer(schedule_app, name="schedule")


def _parse_api_keys(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    from deploy.limits import KeyGrant

    keys = {}
    for item in items:
        key, _, grant = item.partition(":")
        try:
            if not key:
                raise ValueError("empty key")
            KeyGrant.parse(grant)
        except ValueError:
            raise typer.BadParameter(f"--api-key {item!r} must be KEY:TENANT or KEY:TENANT:MODEL[+MODEL...]") from None
        keys[key] = grant
    return keys


UP_ONLY = ("host", "port", "redis_url", "num_cpus")  # `tide up --config` keys that are not AppArgs fields


def _read_config(path: Path) -> dict:
    """A `tide up --config` file: a YAML mapping of ``deploy.app_args.AppArgs`` fields (and host,
    port, redis_url, num_cpus); a bad one is a usage error naming the field."""
    import yaml
    from pydantic import ValidationError

    from deploy.app_args import AppArgs

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise typer.BadParameter(f"--config {str(path)!r}: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise typer.BadParameter(f"--config {str(path)!r} must hold a mapping of AppArgs fields")
    try:
        AppArgs(**{k: v for k, v in raw.items() if k not in UP_ONLY})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "?"
        raise typer.BadParameter(f"--config {str(path)!r}: {field}: {err['msg']}") from None
    return raw


def _startup_view(console):
    """Render replicas' start-up progress (``actors.startup``) as a live table on stderr, or, where
    stderr is no terminal (a log file, CI), as a line for each stage a replica enters."""
    from rich.live import Live
    from rich.table import Table

    live = Live(console=console, transient=True, refresh_per_second=4)
    logged: dict[str, str] = {}  # replica -> the stage last logged (no terminal)

    def show(replicas: dict[str, dict]) -> None:
        if not replicas:
            return
        if not console.is_terminal:
            for name, r in sorted(replicas.items()):
                if logged.get(name) != r.get("stage"):
                    logged[name] = r.get("stage", "?")
                    console.log(f"replica {_replica_id(name)}: {logged[name]}")
            return
        table = Table(box=None, show_header=False, pad_edge=False)
        for name, r in sorted(replicas.items()):
            detail = ""
            if r.get("stage") == "loading weights" and r.get("total_bytes"):
                detail = (f"shard {min(r['shards'] + 1, r['total_shards'])}/{r['total_shards']}  "
                          f"{r['bytes'] / 1e6:,.1f}/{r['total_bytes'] / 1e6:,.1f} MB "
                          f"({100 * r['bytes'] / r['total_bytes']:.0f}%)")
            table.add_row(f"  {_replica_id(name)}", r.get("stage", "?"), detail)
        if not live.is_started:
            live.start()
        live.update(table)

    return live, show


def _replica_id(name: str) -> str:
    """A Serve replica's actor name (SERVE_REPLICA::app#Deployment#id) without its app: Deployment#id."""
    return name.split("#", 1)[-1]


@app.command()
def up(
    ctx: typer.Context,
    config: Path = typer.Option(None, "--config", help="YAML file of deploy.app_args.AppArgs fields (and host, port, redis_url, num_cpus); options given here win"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    model_name: str = typer.Option("tiny", "--model-name", help="the model id clients ask for"),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP bind address (loopback by default: then every Ray, cache-agent and expert-parallel listener binds to loopback too)"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    redis_url: str = typer.Option(None, "--redis-url", help="the cache directory: a Redis (redis://, rediss://) or "
                                  "a Redis Cluster (redis+cluster://host:port,...); default: a local redis-server"),
    replicas: int = typer.Option(1, "--replicas", min=1, help="model replicas (with --decode-replicas: the prefill replicas)"),
    decode_replicas: int = typer.Option(0, "--decode-replicas", min=0, help="P/D disaggregation: this many decode replicas take each prompt's KV from the prefill replicas (0: every replica does both)"),
    num_cpus: int = typer.Option(None, "--num-cpus", min=1, help="CPUs Ray may use (default: all)"),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="unit store directory (default: $TIDE_HOME/cache)"),
    ssd_gb: float = typer.Option(8.0, "--ssd-gb", min=0.001),
    cache_layout: str = typer.Option("segment", "--cache-layout", help="unit files on disk: segment (one file per write batch) | unit (one file per unit)"),
    admission: str = typer.Option("all", "--admission", help="all | second-sight"),
    api_key: list[str] = typer.Option(None, "--api-key", help="KEY:TENANT[:MODEL+...] (the models the key may use; default all); repeat for several (default: no auth)"),
    expert_shards: int = typer.Option(0, "--expert-shards", min=0, help="routed experts on N expert-shard actors shared by every replica (0: in the replica)"),
    expert_rebalance_s: float = typer.Option(0.0, "--expert-rebalance-s", min=0.0, help="with --expert-shards: re-plan expert placement from the measured load this often (0: only `tide eplb rebalance`)"),
    micro_batches: int = typer.Option(1, "--micro-batches", min=1, max=2, help="2: overlap expert rounds with attention"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="with --device cuda: run every decode step eagerly instead of replaying the CUDA graph captured for its batch size"),
    ep_wire: str = typer.Option("auto", "--ep-wire", help="with --expert-shards, how rows travel to the shards and back: fp8 (FP8 dispatch, BF16 combine, as DeepSeek serves V3) | native (the model's dtype) | auto (fp8 for a bfloat16 model)"),
    ep_backend: str = typer.Option("auto", "--ep-backend", help="with --expert-shards, what moves the rows: nccl (GPU to GPU, the rows never cross host memory) | gloo (through host memory) | auto (nccl on CUDA, else gloo)"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (each replica, and each expert shard, takes one GPU and runs the Triton kernels)"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    cpu_threads: int = typer.Option(None, "--cpu-threads", min=1, help="torch threads of each CPU replica (default: the machine's CPUs but one, shared by the replicas; OMP_NUM_THREADS, where set, stands)"),
    cpu_weights: str = typer.Option("fp32", "--cpu-weights", help="fp32 | int8: a CPU replica holds its projections and routed experts as int8 with a scale per 128 columns (a quarter of the bytes a decode step reads; float32 models only)"),
    fp8_weights: str = typer.Option("auto", "--fp8-weights", help="auto | keep | dequantize: an fp8 checkpoint's (DeepSeek-V3/R1 as published) weights stay fp8 on CUDA and run the block-scaled fp8 GEMMs (auto), always (keep), or are dequantized to --dtype at load"),
    speculative_tokens: int = typer.Option(None, "--speculative-tokens", min=0, max=8, help="drafts per sequence and step from the checkpoint's MTP layers, where it has them (0: off; default: 1 with --device cuda, 0 on the CPU, where drafting gains about a tenth up to batch 4 but costs each prompt a quarter more prefill); steps of more than speculative_max_batch sequences (8) decode without drafts"),
    insecure: bool = typer.Option(False, "--insecure", help="allow a --host other than loopback without API keys (anyone who reaches it may use the model)"),
) -> None:
    """Start a local cluster (redis-server, Ray, the Serve app) serving the model over HTTP."""
    from click.core import ParameterSource
    from rich.console import Console

    from deploy.local import up as start

    given = {name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    args = {"checkpoint": str(checkpoint) if checkpoint else None, "model_name": model_name,
            "replicas": replicas, "decode_replicas": decode_replicas, "cache_dir": str(cache_dir) if cache_dir else None,
            "ssd_gb": ssd_gb, "cache_layout": cache_layout, "admission": admission, "api_keys": _parse_api_keys(api_key),
            "expert_shards": expert_shards, "expert_rebalance_s": expert_rebalance_s, "micro_batches": micro_batches,
            "enforce_eager": enforce_eager, "ep_wire": ep_wire, "ep_backend": ep_backend, "device": device, "dtype": dtype, "cpu_weights": cpu_weights,
            "cpu_threads": cpu_threads, "fp8_weights": fp8_weights, "speculative_tokens": speculative_tokens}
    cli_names = {"api_keys": "api_key"}
    edge = {"host": host, "port": port, "redis_url": redis_url, "num_cpus": num_cpus}
    if config is not None:
        for key, value in _read_config(config).items():
            target = edge if key in UP_ONLY else args
            if cli_names.get(key, key) not in given:  # an option on the command line wins over the file
                target[key] = value
    host, port, redis_url, num_cpus = edge["host"], edge["port"], edge["redis_url"], edge["num_cpus"]
    check_checkpoint(Path(args["checkpoint"]) if args["checkpoint"] else None)
    check_redis_url(redis_url)
    if args["ep_wire"] not in ("auto", "native", "fp8"):
        raise typer.BadParameter(f"--ep-wire {args['ep_wire']!r} is not one of auto, native, fp8")
    if args["ep_backend"] not in ("auto", "gloo", "nccl"):
        raise typer.BadParameter(f"--ep-backend {args['ep_backend']!r} is not one of auto, gloo, nccl")
    if args["ep_backend"] == "nccl" and args["device"] != "cuda":
        raise typer.BadParameter(f"--ep-backend nccl needs --device cuda (got --device {args['device']})")
    if args["admission"] not in ("all", "second-sight"):
        raise typer.BadParameter(f"--admission {args['admission']!r} is not one of all, second-sight")
    if args["cache_layout"] not in ("segment", "unit"):
        raise typer.BadParameter(f"--cache-layout {args['cache_layout']!r} is not one of segment, unit")
    check_device(args["device"])
    check_dtype(args["dtype"])
    if args["cpu_weights"] not in ("fp32", "int8"):
        raise typer.BadParameter(f"--cpu-weights {args['cpu_weights']!r} is not one of fp32, int8")
    if args["fp8_weights"] not in ("auto", "keep", "dequantize"):
        raise typer.BadParameter(f"--fp8-weights {args['fp8_weights']!r} is not one of auto, keep, dequantize")
    if args["fp8_weights"] == "keep" and args["device"] != "cuda":
        raise typer.BadParameter("--fp8-weights keep needs --device cuda (the fp8 GEMMs are Triton kernels)")
    if args["cpu_weights"] == "int8" and (args["device"] != "cpu" or args["dtype"] != "float32"):
        raise typer.BadParameter("--cpu-weights int8 is for float32 models on the CPU (--device cpu --dtype float32)")
    from deploy.ray_head import is_loopback

    if not is_loopback(host) and not (args["api_keys"] or os.environ.get("TIDE_API_KEYS")) and not insecure:
        raise typer.BadParameter(f"--host {host} serves the API beyond this machine without API keys; give "
                                 "--api-key KEY:TENANT (or TIDE_API_KEYS), or --insecure to serve it open")
    console = Console(stderr=True)
    live, show = _startup_view(console)
    with console.status("starting tideserve") as status:
        try:
            state = start(args, host, port, redis_url, num_cpus,
                          step=lambda msg: (status.update(msg), console.log(msg)), startup=show)
        except KeyboardInterrupt:
            typer.echo("interrupted: what had started was stopped", err=True)
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - one clear line (or Ray's/Serve's own last lines), no traceback
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        finally:
            if live.is_started:
                live.stop()
    name = args["model_name"]
    typer.echo(f"tideserve is up: {state['url']}  (model {name!r}; stop with `tide down`)")
    typer.echo(f"try: curl {state['url']}/chat/completions -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")


@app.command()
def down() -> None:
    """Stop the local cluster that `tide up` started (its processes only; other Ray clusters on
    this machine keep running)."""
    from deploy.local import down as stop

    if not stop():
        typer.echo("no local cluster is running (nothing to stop)", err=True)
        raise typer.Exit(1)
    typer.echo("tideserve is down")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"tideserve {version('tideserve')}")
        except PackageNotFoundError:
            typer.echo("tideserve (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """tideserve: serve DeepSeek-style models (MLA + MoE) on Ray with a disk prompt cache."""


def main(argv: list[str] | None = None) -> None:
    """The ``tide`` console entry (``argv``: the arguments, default ``sys.argv[1:]``): runtime
    conditions (no cluster, a dead head, nothing to lend) are one line and exit status 1; usage
    errors exit 2."""
    from deploy.connect import TideError, disconnect

    try:
        app(args=argv)
    except TideError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(1) from None
    finally:
        disconnect()


if __name__ == "__main__":
    main()
