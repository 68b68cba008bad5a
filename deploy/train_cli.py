"""``tide train``: train the tideserve architecture on the standard library's docstrings.

``run`` trains in this process (resumable: run it again with the same ``--out`` and it continues;
SIGTERM or SIGINT checkpoints and stops, which is how the morning scale-up ends a night's
training). ``export`` writes a compact serving checkpoint (bf16 by default) from a training run;
the default model shipped in ``model/weights/tiny`` was made by

    tide train run --out runs/tiny --minutes 45 && tide train export runs/tiny model/weights/tiny
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import typer

from deploy.connect import ADDRESS_HELP, TideError
from deploy.options import check_dtype

ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP)

train_app = typer.Typer(help="Train the model architecture (resumable, HF-format checkpoints).", no_args_is_help=True)


@train_app.command("run")
def train_run(
    out: Path = typer.Option(..., "--out", help="checkpoint directory (resumed when it holds one)"),
    config: str = typer.Option("tiny", "--config", help="named model config for a new run"),
    steps: int = typer.Option(100000, "--steps", min=1, help="total optimizer steps (the LR schedule's length)"),
    minutes: float = typer.Option(None, "--minutes", min=0.0, help="stop (with a checkpoint) after this long"),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    seq_len: int = typer.Option(256, "--seq-len", min=32),
    lr: float = typer.Option(3e-3, "--lr", min=0.0),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1),
    docs_limit: int = typer.Option(None, "--docs-limit", min=1, help="use only the first N docstrings"),
    corpus_kind: str = typer.Option("docstrings", "--corpus",
                                    help="docstrings (each as text or a chat turn) | mixed (also brief and JSON answers)"),
    seed: int = typer.Option(0, "--seed"),
    mtp_layers: int = typer.Option(1, "--mtp-layers", min=0,
                                   help="multi-token-prediction layers trained beside the model (the speculative "
                                        "decoding draft; 0: none)"),
    mtp_weight: float = typer.Option(0.3, "--mtp-weight", min=0.0, help="the MTP loss's weight beside the main loss"),
    init_from: Path = typer.Option(None, "--from", help="start from this checkpoint's weights (its config too)"),
    only_mtp: bool = typer.Option(False, "--only-mtp",
                                  help="train only the MTP layers: the model's own weights stay as they are"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON line per step"),
) -> None:
    """Train on the docstrings of this Python's standard library (offline, English)."""
    import dataclasses

    from model.config import ModelConfig, load_config, named_config
    from model.train import CORPORA, TrainConfig, Trainer, encode_corpus, stdlib_documents

    try:
        cfg = load_config(init_from) if init_from is not None else named_config(config)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"{cfg.model_type} trains elsewhere: tide train runs the MLA (V2/V3/V3.2) architecture")
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=mtp_layers)
        train = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, min_lr=lr / 10,
                            checkpoint_every=checkpoint_every, seed=seed, mtp_weight=mtp_weight, only_mtp=only_mtp)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    if corpus_kind not in CORPORA:
        raise typer.BadParameter(f"--corpus {corpus_kind!r} is not one of {', '.join(CORPORA)}")
    corpus = encode_corpus(stdlib_documents(limit=docs_limit), seed, corpus_kind)
    try:
        trainer = Trainer(cfg, train, out, corpus, init_from)
    except ValueError as e:  # a run directory that cannot be resumed
        raise TideError(f"--out {str(out)!r}: {e}") from None
    stop = {"now": False}

    def on_signal(signum, frame) -> None:
        stop["now"] = True  # finish the step, checkpoint, exit

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None

    from deploy.term import progress

    start_step = trainer.step
    # on a terminal: a bar with an ETA (to --steps, or to --minutes when that comes first)
    with progress("training", steps, enabled=not as_json) as bar:
        def report(row: dict) -> None:
            if as_json:
                sys.stdout.write(json.dumps(row) + "\n")
                sys.stdout.flush()
                return
            bar.update(row["step"], description=f"training: loss {row['loss']:.3f}, {row['tokens_per_s']:.0f} tok/s")
            if row["step"] % 10 == 0 and not sys.stderr.isatty():  # logs: a line every 10 steps
                print(f"step {row['step']}: loss {row['loss']:.3f}  {row['tokens_per_s']:.0f} tok/s", file=sys.stderr)

        last = trainer.run(deadline, lambda: stop["now"], report)
    summary = {"out": str(out), "started_at_step": start_step, "step": trainer.step, "loss": last.get("loss"),
               "corpus_tokens": int(corpus.numel()), "stopped_by_signal": stop["now"]}
    sys.stdout.write(json.dumps({"done": summary}) + "\n")


@train_app.command("export")
def train_export(
    run_dir: Path = typer.Argument(..., help="a `tide train run --out` directory"),
    dest: Path = typer.Argument(..., help="serving checkpoint directory to write"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | bfloat16 | float16"),
) -> None:
    """Write a serving checkpoint (config.json + model.safetensors) from a training run."""
    check_dtype(dtype)
    from model.checkpoint import DTYPES, load_config, load_state_dict, save_checkpoint
    from model.config import WEIGHTS_FILE

    if not (run_dir / WEIGHTS_FILE).is_file():
        raise typer.BadParameter(f"{str(run_dir)!r} holds no {WEIGHTS_FILE}")
    cfg = load_config(run_dir)
    sd = load_state_dict(run_dir, cfg, DTYPES[dtype])
    save_checkpoint(dest, cfg, sd)
    size = (dest / WEIGHTS_FILE).stat().st_size
    sys.stdout.write(json.dumps({"dest": str(dest), "bytes": size}) + "\n")


def _cluster(address: str | None):
    """(the cluster's dashboard URL, its day/night state actor, the ray module); connects."""
    from deploy.connect import dashboard_url, find_target, require_app

    target = find_target(address)
    require_app(target)  # connects this process to the cluster
    import ray

    from actors.tidal import tidal_state

    return dashboard_url(target), tidal_state(), ray


@train_app.command("submit")
def train_submit(
    out: Path = typer.Option(None, "--out", help="checkpoint directory on the lent node (default: $TIDE_HOME/train/night)"),
    entrypoint: str = typer.Option(None, "--entrypoint", help="the job's command (default: `tide train run --out OUT`)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = ADDRESS,
) -> None:
    """Submit a training job through the Ray Jobs API, its driver pinned to the lent nodes
    (lend them with `tide scale night`); `tide scale day` stops it with a checkpoint."""
    dashboard, tidal, ray = _cluster(address)
    from actors.tidal import submit_training
    from model.default import cache_root

    lent = [n for n, r in ray.get(tidal.roles.remote()).items() if r == "lent"]
    if not lent:
        raise TideError("no node is lent to training (run `tide scale night` first)")
    if ray.get(tidal.job.remote()):
        raise TideError(f"job {ray.get(tidal.job.remote())} is already training (tide train stop)")
    out = out or cache_root() / "train" / "night"
    cmd = entrypoint or f"{sys.executable} -m deploy.cli train run --out {out}"
    job_id = submit_training(lent, {"entrypoint": cmd, "dashboard": dashboard})
    ray.get(tidal.set_job.remote(job_id))
    out_obj = {"job_id": job_id, "nodes": lent, "entrypoint": cmd}
    sys.stdout.write(json.dumps(out_obj) + "\n" if as_json else f"submitted {job_id} on {', '.join(n[:12] for n in lent)}\n")


@train_app.command("status")
def train_status(as_json: bool = typer.Option(False, "--json", help="print JSON"), address: str = ADDRESS) -> None:
    """The night's training job: status, the node its driver runs on, the last log lines."""
    dashboard, tidal, ray = _cluster(address)
    from actors.tidal import jobs_client

    job_id = ray.get(tidal.job.remote())
    if job_id is None:
        out = {"job_id": None, "status": None}
    else:
        client = jobs_client(dashboard)
        info = client.get_job_info(job_id)
        out = {"job_id": job_id, "status": str(info.status.value if hasattr(info.status, "value") else info.status),
               "node": info.driver_node_id, "logs_tail": client.get_job_logs(job_id)[-2000:]}
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
    elif job_id is None:
        print("no training job (lend nodes with `tide scale night`, then `tide train submit`)")
    else:
        print(f"job {job_id}: {out['status']} (driver on node {str(out['node'])[:12]})")
        if out["logs_tail"]:
            print("last log lines:\n  " + "\n  ".join(out["logs_tail"].splitlines()[-10:]))


@train_app.command("stop")
def train_stop(
    deadline_s: float = typer.Option(60.0, "--deadline", min=0.0, help="seconds to checkpoint before it is killed"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = ADDRESS,
) -> None:
    """Signal the training job to checkpoint and stop (SIGTERM), then stop it after the deadline."""
    dashboard, tidal, ray = _cluster(address)
    from actors.tidal import stop_training

    job_id = ray.get(tidal.job.remote())
    if job_id is None:
        raise TideError("no training job is running")
    status = stop_training(job_id, deadline_s, dashboard)
    ray.get(tidal.set_job.remote(None))
    out = {"job_id": job_id, "status": status}
    sys.stdout.write(json.dumps(out) + "\n" if as_json else f"{job_id}: {status}\n")
