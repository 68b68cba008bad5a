"""``tide batch``: every tenant's batch jobs (``/v1/batches``) on the running cluster, through its
ingress (which keeps them in the cluster's Redis): list, show, cancel."""

from __future__ import annotations

import json
import sys
from datetime import datetime

import typer

from deploy.connect import ADDRESS_HELP

batch_app = typer.Typer(help="Batch jobs (/v1/batches) of every tenant: list, show, cancel.", no_args_is_help=True)
ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP)
JSON = typer.Option(False, "--json", help="print JSON")
TIMEOUT_S = 60.0


def _call(address: str | None, action: str, batch_id: str | None = None, include_ended: bool = False) -> list[dict]:
    from deploy.connect import TideError, find_target, serve_handle

    handle = serve_handle(find_target(address), "OpenAIIngress")
    try:
        return handle.batch_admin.remote(action, batch_id, include_ended).result(timeout_s=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the ingress's refusal (no such batch, Redis down) as one line
        cause = getattr(e, "cause", e)
        raise TideError(getattr(cause, "message", None) or str(cause)) from None


def _check_id(batch_id: str) -> str:
    if not batch_id.startswith("batch_") or len(batch_id) > 64:
        raise typer.BadParameter(f"{batch_id!r} is not a batch id (batch_...)")
    return batch_id


@batch_app.command("list")
def list_(everything: bool = typer.Option(False, "--all", help="also the batches that ended (kept 30 days)"),
          address: str = ADDRESS, as_json: bool = JSON) -> None:
    """The batches not ended (with --all: every one kept), oldest first, with their progress."""
    jobs = _call(address, "list", include_ended=everything)
    if as_json:
        sys.stdout.write(json.dumps({"batches": jobs}) + "\n")
        return
    from rich.table import Table

    from deploy.term import stdout_console

    table = Table(title=f"{len(jobs)} batch(es)" + ("" if everything else " not ended"))
    for col in ("id", "tenant", "status", "endpoint", "done / total", "failed", "created", "expires"):
        table.add_column(col)
    for j in jobs:
        counts = j["request_counts"]
        table.add_row(j["id"], j["tenant"] or "(none)", j["status"], j["endpoint"],
                      f"{counts['completed'] + counts['failed']} / {counts['total']}", str(counts["failed"]),
                      _when(j["created_at"]), _when(j["expires_at"]))
    stdout_console().print(table)


@batch_app.command("show")
def show(batch_id: str = typer.Argument(..., callback=_check_id), address: str = ADDRESS, as_json: bool = JSON) -> None:
    """One batch as its tenant's client sees it (GET /v1/batches/{id}), with its tenant."""
    (job,) = _call(address, "show", batch_id)
    sys.stdout.write(json.dumps(job, indent=None if as_json else 2) + "\n")


@batch_app.command("cancel")
def cancel(batch_id: str = typer.Argument(..., callback=_check_id), address: str = ADDRESS,
           as_json: bool = JSON) -> None:
    """Cancel a batch: the lines under way finish, the rest never run; those done stay in its files."""
    (job,) = _call(address, "cancel", batch_id)
    if as_json:
        sys.stdout.write(json.dumps(job) + "\n")
        return
    print(f"{job['id']} ({job['tenant'] or 'no tenant'}): {job['status']}")


def _when(t: int | None) -> str:
    return "" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")
