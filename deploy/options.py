"""Checks of command-line values that several ``tide`` commands share. Each raises
``typer.BadParameter`` naming the option and the bad value; none imports torch."""

from __future__ import annotations

from pathlib import Path

import typer

from model.config import DTYPE_NAMES, check_checkpoint_dir

__all__ = ["check_checkpoint", "check_device", "check_dtype"]


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_NAMES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {list(DTYPE_NAMES)}")


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r} is not one of cpu, cuda")


def check_checkpoint(checkpoint: Path | None) -> None:
    """A given ``--checkpoint`` must be a servable checkpoint directory (None: the default model)."""
    if checkpoint is None:
        return
    try:
        check_checkpoint_dir(checkpoint)
    except ValueError as e:
        raise typer.BadParameter(f"--checkpoint: {e}") from None


def check_redis_url(url: str | None, option: str = "--redis-url") -> None:
    """A Redis directory URL: one server (redis://, rediss://) or a cluster's seeds
    (redis+cluster://host:port,host:port, rediss+cluster://)."""
    from cachedir.directory import SCHEMES

    schemes = [s for s in SCHEMES if s != "mem"]
    if url is not None and ("://" not in url or url.split("://", 1)[0] not in schemes):
        raise typer.BadParameter(f"{option} {url!r} must start with one of {', '.join(s + '://' for s in schemes)}")
