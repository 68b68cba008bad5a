"""Consoles for the CLI's human output (``--json`` output never goes through them)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

__all__ = ["progress", "stdout_console"]


def stdout_console():
    """A rich console on stdout; piped (a file, ``grep``), 120 columns so table rows stay whole."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


class _Quiet:
    """What ``progress`` gives when nobody watches: updates cost nothing and print nothing."""

    def update(self, completed: float, total: float | None = None, description: str | None = None) -> None:
        pass


class _Bar:
    def __init__(self, bar, task) -> None:
        self.bar, self.task = bar, task

    def update(self, completed: float, total: float | None = None, description: str | None = None) -> None:
        kw = {"completed": completed}
        if total is not None:
            kw["total"] = total
        if description is not None:
            kw["description"] = description
        self.bar.update(self.task, **kw)


@contextmanager
def progress(description: str, total: float | None, enabled: bool = True):
    """A progress bar with an ETA on stderr, shown only on a terminal (never in ``--json``
    output piped elsewhere, never in logs); yields an object with ``update(completed, total,
    description)``."""
    if not (enabled and sys.stderr.isatty()):
        yield _Quiet()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _Bar(bar, bar.add_task(description, total=total))
