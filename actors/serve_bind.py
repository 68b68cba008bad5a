"""Keep a Serve replica's inter-deployment gRPC server on the node's address.

Ray Serve 2.60 starts, in every replica, a gRPC server for inter-deployment calls on ``[::]:0``
(every interface), whatever the cluster's node address is. On a loopback-only cluster (``tide up``
without ``--host``: the node address is 127.0.0.1) that server is the one listener left on every
interface; ``bind_replica_grpc_to_node()``, called where a replica imports our deployment classes
(before Serve starts that server), makes it bind the node's address instead. Elsewhere (a node
address other nodes use) nothing changes. The server carries no traffic unless
``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``.
"""

from __future__ import annotations

import ipaddress

__all__ = ["bind_replica_grpc_to_node"]


def bind_replica_grpc_to_node() -> None:
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:  # not inside Ray Serve
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_tide_bound", False):
        return

    def add_port(server, address: str):
        host, _, port = address.rpartition(":")
        if host == "[::]" and ray.is_initialized():
            node = ray.util.get_node_ip_address()
            if ipaddress.ip_address(node).is_loopback:
                address = f"{node}:{port}"
        return original(server, address)

    add_port._tide_bound = True
    replica.add_port_to_grpc_server = add_port
