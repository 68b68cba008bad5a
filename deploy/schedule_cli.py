"""``tide schedule``: the day/night windows ``tide scale`` and ``tide stats`` use, kept in
``$TIDE_HOME/schedule.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from cluster.scaling import Schedule

schedule_app = typer.Typer(help="Day/night schedule for scaling.", no_args_is_help=True)

DEFAULT = {"day": "08:00", "night": "00:00", "timezone": "Asia/Shanghai", "night_nodes": 1}


def schedule_path() -> Path:
    from model.default import cache_root

    return cache_root() / "schedule.json"


def load_schedule() -> dict:
    """The saved schedule (defaults where nothing is saved)."""
    path = schedule_path()
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {**DEFAULT, **saved}


@schedule_app.command("show")
def schedule_show(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """The day/night windows, timezone and the night's serving-node goal."""
    s = load_schedule()
    sys.stdout.write(json.dumps(s) + "\n" if as_json else
                     f"day from {s['day']}, night from {s['night']} ({s['timezone']}); night goal {s['night_nodes']} node(s)\n")


@schedule_app.command("set")
def schedule_set(
    day: str = typer.Option(None, "--day", help="HH:MM when the day (full serving) starts"),
    night: str = typer.Option(None, "--night", help="HH:MM when the night (lending) starts"),
    timezone: str = typer.Option(None, "--tz", help="IANA timezone, e.g. Asia/Shanghai"),
    night_nodes: int = typer.Option(None, "--night-nodes", min=1, help="serving nodes the night aims for"),
) -> None:
    """Change any of the schedule's fields (the others keep their values)."""
    s = load_schedule()
    for key, value in (("day", day), ("night", night), ("timezone", timezone), ("night_nodes", night_nodes)):
        if value is not None:
            s[key] = value
    try:
        Schedule.parse(s["day"], s["night"], s["timezone"])
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    path = schedule_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(s, indent=2))
    tmp.replace(path)
    sys.stdout.write(json.dumps(s) + "\n")
