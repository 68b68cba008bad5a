"""``EPGroup``: an attention replica's expert-parallel group (Ray owns the shards, a collective
group moves data: NCCL between GPUs, else gloo; ``cluster.ep_comm``).

Runs inside the replica's process. It joins the app's ``EPControl`` (which owns the placement
every replica serves), forms a group with the placement's expert shards (the replica is rank 0;
every replica has a group of its own with the same shards), and hands the model a
``cluster.ep.EPExecutor``.

* Following the placement: a thread polls the control (reporting the version served and the
  measured expert load). When the control names a new version, the executor switches to it
  between two rounds; when the new version lives on other shards (a resize), a group with them is
  formed first and the old one stopped after the switch.
* Recovery: when a round fails (a shard died or hung), the executor calls ``recover``: the
  control reloads the served version where a shard lost it (Ray restarts a dead one), the group
  is re-formed on a fresh port, and the layer is resent.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid

import ray
import torch

from cluster.ep import EPExecutor, EPTransportError, Wire
from cluster.ep_comm import (
    CollectiveTransport,
    form_group,
    group_backend,
    group_device,
    listen_socket,
)

__all__ = ["EPGroup", "expert_shard_actor"]

log = logging.getLogger(__name__)


def expert_shard_actor(**options):
    """The ``ray.remote`` shell of ``ExpertShard`` (restarted when it dies)."""
    from actors.expert_shard import ExpertShard

    return ray.remote(max_restarts=-1, max_task_retries=-1, **options)(ExpertShard)


def _same_shards(a: list, b: list) -> bool:
    return [s._actor_id for s in a] == [s._actor_id for s in b]


class EPGroup:
    def __init__(
        self,
        control,
        replica_id: str,
        hidden: int,
        dtype: torch.dtype,
        timeout_s: float = 30.0,
        recover_deadline_s: float = 180.0,
        poll_s: float = 0.25,
        wire: Wire | None = None,
        device: str | torch.device = "cpu",
        backend: str = "auto",
    ) -> None:
        """``control``: the app's ``EPControl`` actor; ``timeout_s``: a round slower than this
        counts as a failed shard; ``poll_s``: how often to ask the control for a new placement;
        ``device``: the replica's; ``backend``: auto | gloo | nccl (``cluster.ep_comm.group_backend``)."""
        self.control = control
        self.replica_id = replica_id
        self.hidden = hidden
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.wire = wire if wire is not None else Wire.deepseek(dtype)  # how rows travel (cluster.ep.Wire)
        self.recover_deadline_s = recover_deadline_s
        self.poll_s = poll_s
        self.backend = group_backend(backend, device)
        self.device = group_device(self.backend, device)
        self.host = ray.util.get_node_ip_address()
        self.executor: EPExecutor | None = None
        self.stats = {"reforms": 0, "switches": 0, "poll_failures": 0}
        self._shards_of: dict[int, list] = {}  # placement version -> its shards
        self._transport: CollectiveTransport | None = None
        self._pending: tuple[int, CollectiveTransport | None] | None = None  # a switch not yet applied
        self._stopped = threading.Event()

    @property
    def shards(self) -> list:
        """The shards of the placement the executor serves now."""
        return self._shards_of[self.executor.version]

    # -- setup ----------------------------------------------------------------------------
    def start(self) -> EPExecutor:
        target = ray.get(self.control.join.remote(self.replica_id))
        version, shards = target["version"], target["shards"]
        self._shards_of[version] = shards
        self._transport = self._form(shards)
        self.executor = EPExecutor(target["placement"], target["moe_layers"], self._transport,
                                   recover=self._recover, version=version, wire=self.wire)
        threading.Thread(target=self._follow, name="ep-follow", daemon=True).start()
        return self.executor

    def stop(self) -> None:
        self._stopped.set()
        try:
            self.control.leave.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - shutting down: the control forgets us after its timeout
            pass

    def _form(self, shards: list) -> CollectiveTransport:
        world = len(shards) + 1
        # the group's store listens on this node's cluster address only (loopback under `tide up`)
        sock, group_id = listen_socket(self.host), uuid.uuid4().hex[:12]
        port = sock.getsockname()[1]
        key = secrets.token_bytes(32)  # the group's members prove they hold it (through Ray only)
        for rank, shard in enumerate(shards, start=1):
            shard.join.remote(group_id, self.host, port, rank, world, self.timeout_s, self.hidden, key, self.wire,
                              self.backend)
        pg = form_group(self.host, port, 0, world, self.timeout_s, bind=self.host, listen_fd=sock.detach(),
                        key=key, group_id=group_id, backend=self.backend, device=self.device)
        return CollectiveTransport(pg, world, self.dtype, self.wire, self.device)

    # -- following the control's placement ---------------------------------------------------
    def _follow(self) -> None:
        while not self._stopped.wait(self.poll_s):
            try:
                self._follow_once()
            except Exception as e:  # noqa: BLE001 - keep serving the current placement; ask again
                self.stats["poll_failures"] += 1
                log.warning("expert placement poll failed (%s); serving version %s", e, self.executor.version)
                self._stopped.wait(1.0)

    def _follow_once(self) -> None:
        ex = self.executor
        if self._pending is not None and ex.version == self._pending[0]:
            self._finish_switch()
        target = ray.get(self.control.poll.remote(self.replica_id, ex.version, ex.load.clone()), timeout=30)
        if target is not None and target.get("rejoin"):  # the control restarted: tell it what we serve
            target = ray.get(self.control.join.remote(
                self.replica_id, (ex.version, ex.placement, self.shards)), timeout=60)
        if target is None or target["version"] == ex.version:
            return
        if self._pending is not None and self._pending[0] == target["version"]:
            return  # switching already; the executor applies it between rounds
        self._begin_switch(target)

    def _begin_switch(self, target: dict) -> None:
        version, shards = target["version"], target["shards"]
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].stop()  # superseded before it was used
        transport = None if _same_shards(shards, self.shards) else self._form(shards)
        self._shards_of[version] = shards
        self._pending = (version, transport)
        self.executor.switch_placement(target["placement"], version, transport)
        if self.executor.version == version:  # idle: applied at once
            self._finish_switch()

    def _finish_switch(self) -> None:
        version, transport = self._pending
        self._pending = None
        if transport is not None:
            old, self._transport = self._transport, transport
            if old is not None:
                old.stop()
        self._shards_of = {v: s for v, s in self._shards_of.items() if v == version}
        self.stats["switches"] += 1

    # -- failures ---------------------------------------------------------------------------
    def _recover(self, error: BaseException) -> CollectiveTransport:
        """Called by the executor (engine thread) when a round fails; returns a new transport."""
        log.warning("expert-parallel round failed (%s); re-forming the group", error)
        self._transport = None  # drop our side of the broken group
        assert self.executor is not None
        version = self.executor.version
        shards = self._shards_of[version]
        deadline = time.monotonic() + self.recover_deadline_s
        while True:
            try:
                ray.get(self.control.ensure_loaded.remote(version), timeout=60)
                transport = self._form(shards)
                break
            except ValueError as e:  # the version was dropped (we were taken for gone): fail the
                # round now, so that the switch to the current placement can happen
                raise EPTransportError(str(e).splitlines()[-1]) from e
            except (ray.exceptions.RayError, RuntimeError) as e:
                if time.monotonic() > deadline:
                    raise EPTransportError(f"expert shards did not recover within {self.recover_deadline_s}s: {e}") from e
                log.info("waiting for expert shards to come back: %s", e)
                time.sleep(1.0)
        self.stats["reforms"] += 1
        self._transport = transport
        return transport
