"""What every benchmark's JSON says about where it ran: the machine and the versions that matter."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

__all__ = ["machine", "rss_mb"]


def machine() -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": version("torch"), "ray": version("ray"), "redis_py": version("redis"),
            "tideserve": version("tideserve")}


def rss_mb(pids: list[int]) -> float:
    """Resident memory of the processes ``pids`` (from /proc; one gone meanwhile counts 0), in MB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024
