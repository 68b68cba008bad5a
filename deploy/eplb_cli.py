"""``tide eplb``: expert placement. ``plan`` is offline (a load file in, a placement out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from deploy.connect import ADDRESS_HELP, TideError

ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP)
eplb_app = typer.Typer(help="Expert-parallel load balancing (expert placement).", no_args_is_help=True)


def read_load(path: Path):
    """A JSON load matrix [layers][experts] of non-negative numbers -> a [L, E] double tensor."""
    import torch

    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise typer.BadParameter(f"--load {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"--load {str(path)!r} is not JSON: {e}") from None
    if isinstance(data, dict) and "load" in data:
        data = data["load"]
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(row, list) and row and len(row) == len(data[0]) for row in data)
    ):
        raise typer.BadParameter(f"--load {str(path)!r} must hold a non-empty [layers][experts] matrix")
    try:
        return torch.tensor(data, dtype=torch.double)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"--load {str(path)!r} must hold numbers only") from None


@eplb_app.command("plan")
def eplb_plan(
    load: Path = typer.Option(..., "--load", help="JSON [layers][experts] tokens per expert (or {\"load\": ...})"),
    slots: int = typer.Option(..., "--slots", help="physical expert slots (>= experts)"),
    groups: int = typer.Option(1, "--groups", help="expert groups (n_group)"),
    nodes: int = typer.Option(1, "--nodes", help="nodes the shards are spread over"),
    shards: int = typer.Option(..., "--shards", help="expert shards (GPUs / shard actors)"),
    policy: str = typer.Option("auto", "--policy", help="auto | global | hierarchical | spill"),
    spill_copies: int = typer.Option(16, "--spill-copies", help="policy spill: copies per layer moved across nodes"),
    previous: Path = typer.Option(None, "--previous", help="an earlier plan's JSON: re-plan moving few weights"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Place experts on shard slots; prints phy2log, log2phy, logcnt and the imbalance
    (max/mean load per shard, averaged over layers) before and after."""
    from cluster.eplb import EplbConfig, Placement, imbalance, moved_slots, plan, spill_fraction

    matrix = read_load(load)
    try:
        cfg = EplbConfig(slots, groups, nodes, shards, policy, spill_copies)
        prev = None
        if previous is not None:
            old = json.loads(previous.read_text())
            import torch

            prev = Placement.from_phy2log(torch.tensor(old["phy2log"]), matrix.shape[1], shards)
        placement = plan(matrix, cfg, previous=prev)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise typer.BadParameter(f"--previous {str(previous)!r} is not a plan printed by this command: {e}") from None
    num_layers, num_experts = matrix.shape
    out = {
        "policy": cfg.resolve_policy(num_experts),
        "layers": num_layers,
        "experts": num_experts,
        "slots": slots,
        "shards": shards,
        "imbalance_before": round(imbalance(Placement.in_order(num_layers, num_experts, shards), matrix), 4)
        if num_experts % shards == 0
        else None,
        "imbalance": round(imbalance(placement, matrix), 4),
        "spill_fraction": round(spill_fraction(placement, matrix, groups, nodes), 4),
        "phy2log": placement.phy2log.tolist(),
        "log2phy": placement.log2phy.tolist(),
        "logcnt": placement.logcnt.tolist(),
    }
    if prev is not None:
        out["moved_slots"] = moved_slots(prev, placement)
    sys.stdout.write(json.dumps(out) + "\n")


def _control(address: str | None):
    """The running cluster's ``EPControl`` (connects to the cluster; call it before importing
    ray: the connection sets Ray's auth mode first)."""
    from deploy.connect import find_target, require_app
    from deploy.ep_admin import find_ep_control

    require_app(find_target(address))  # connects
    control = find_ep_control()
    if control is None:
        raise TideError("this cluster does not use expert parallelism (tide up --expert-shards N)")
    return control


@eplb_app.command("show")
def eplb_show(as_json: bool = typer.Option(False, "--json", help="print JSON"), address: str = ADDRESS) -> None:
    """The running cluster's expert placement: version, shards, copies per expert, the load
    every replica measured, and the version each replica serves."""
    control = _control(address)  # first: it sets Ray's auth mode before ray is imported
    import ray
    import torch

    from cluster.eplb import Placement
    from deploy.ep_admin import placement_imbalance

    info, load = ray.get([control.info.remote(), control.load.remote()], timeout=60)
    if info["version"] is None:
        raise TideError("no replica has joined the expert-parallel group yet; try again shortly")
    phy2log = torch.tensor(info["phy2log"])
    placement = Placement.from_phy2log(phy2log, load.shape[1], info["num_shards"])
    out = {"version": info["version"], "shards": info["num_shards"], "slots": phy2log.shape[1],
           "copies_max": int(placement.logcnt.max()), "imbalance": placement_imbalance(info, load),
           "rebalances": info["rebalances"], "resizes": info["resizes"],
           "replicas": info["replicas"], "phy2log": info["phy2log"]}
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    imb = "unmeasured (no load yet)" if out["imbalance"] is None else f"{out['imbalance']:.3f} (max/mean shard load)"
    print(f"placement version {out['version']}: {out['shards']} shards, {out['slots']} slots, "
          f"up to {out['copies_max']} copies of an expert")
    print(f"  imbalance: {imb}")
    print(f"  rebalances: {out['rebalances']}, resizes: {out['resizes']}")
    for replica, version in sorted(out["replicas"].items()):
        print(f"  replica {replica.split('#')[-1]} serves version {version}")


@eplb_app.command("rebalance")
def eplb_rebalance(as_json: bool = typer.Option(False, "--json", help="print JSON"), address: str = ADDRESS) -> None:
    """Re-plan from the load every replica measured, now; weights move while serving continues
    and every replica switches to the new placement."""
    control = _control(address)  # first: it sets Ray's auth mode before ray is imported
    import ray

    try:
        result = ray.get(control.rebalance.remote(), timeout=600)
    except ValueError as e:  # no replica has joined yet (RayTaskError subclasses it)
        raise TideError(str(e).splitlines()[-1]) from None
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print("\n".join(f"{k.replace('_', ' ')}: {v}" for k, v in result.items()))
