"""Replicas' start-up progress (weights loaded, kernels built, warm-up), for ``tide up`` to show.

A replica writes its stage to Ray's internal key-value store under its actor name; whoever
starts the app reads every replica's entry while it waits. Best effort both ways: progress that
cannot be written or read is simply not shown.
"""

from __future__ import annotations

import json
import time

__all__ = ["StartupReporter", "clear_startup", "read_startup"]

_NAMESPACE = "tideserve"
_PREFIX = "startup:"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


class StartupReporter:
    """Writes one replica's stage; ``update`` is rate-limited to one write per ``every_s``."""

    def __init__(self, replica_id: str, every_s: float = 0.5) -> None:
        self.key = _PREFIX + replica_id
        self.every_s = every_s
        self._last = 0.0

    def update(self, stage: str, force: bool = False, **fields: int | float | str) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        try:
            _kv()._internal_kv_put(self.key, json.dumps({"stage": stage, **fields}), overwrite=True,
                                   namespace=_NAMESPACE)
        except Exception:  # noqa: BLE001 - progress is for show; never fail a replica over it
            pass


def read_startup() -> dict[str, dict]:
    """Replica name -> its last reported stage and fields."""
    kv = _kv()
    out = {}
    try:
        for key in kv._internal_kv_list(_PREFIX, namespace=_NAMESPACE):
            raw = kv._internal_kv_get(key, namespace=_NAMESPACE)
            if raw:
                name = key.decode() if isinstance(key, bytes) else key
                out[name[len(_PREFIX):]] = json.loads(raw)
    except Exception:  # noqa: BLE001 - shown when available
        return {}
    return out


def clear_startup() -> None:
    kv = _kv()
    try:
        for key in kv._internal_kv_list(_PREFIX, namespace=_NAMESPACE):
            kv._internal_kv_del(key, namespace=_NAMESPACE)
    except Exception:  # noqa: BLE001
        pass
