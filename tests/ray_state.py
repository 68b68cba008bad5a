"""The connected Ray's state (``ray.util.state``), asked of this process's cluster: without an
address the state API takes the newest Ray on the machine, which under ``pytest -n`` is often
another worker's."""

from __future__ import annotations


def alive_actors(detail: bool = False) -> list:
    """The live actors of the Ray this process is connected to."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")],
                       limit=1000, detail=detail)
