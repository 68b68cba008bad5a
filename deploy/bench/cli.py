"""``tide bench``: benchmark commands. Each prints one JSON object on stdout."""

from __future__ import annotations

import typer

from deploy.bench.cluster_cli import (
    bench_all,
    bench_cluster,
    bench_directory,
    bench_soak,
    bench_trace,
    bench_ttft,
)
from deploy.bench.engine_cli import (
    bench_engine,
    bench_ep,
    bench_eplb,
    bench_kernels,
    bench_model,
    bench_structured,
    bench_unit_io,
)
from deploy.bench.serve_cli import bench_batch, bench_neighbour, bench_serve, bench_stream

bench_app = typer.Typer(help="Benchmarks; each prints one JSON object.", no_args_is_help=True)
bench_app.command("model")(bench_model)
bench_app.command("engine")(bench_engine)
bench_app.command("eplb")(bench_eplb)
bench_app.command("ep")(bench_ep)
bench_app.command("structured")(bench_structured)
bench_app.command("kernels")(bench_kernels)
bench_app.command("unit-io")(bench_unit_io)
bench_app.command("directory")(bench_directory)
bench_app.command("trace")(bench_trace)
bench_app.command("ttft")(bench_ttft)
bench_app.command("cluster")(bench_cluster)
bench_app.command("serve")(bench_serve)
bench_app.command("neighbour")(bench_neighbour)
bench_app.command("batch")(bench_batch)
bench_app.command("stream")(bench_stream)
bench_app.command("soak")(bench_soak)
bench_app.command("all")(bench_all)
