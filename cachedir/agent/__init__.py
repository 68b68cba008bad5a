"""The per-node cache agent: a gRPC service over the node's unit store (the only place ``grpc``
is imported), its client, and the engine-facing cluster cache that fetches units from any node.

* ``service.py`` — the ``CacheAgent`` service of ``agent.proto`` over a ``NodeCache``; optional
  bearer token and TLS.
* ``client.py`` — ``AgentClient``: fetch (server stream of chunks), has, push, stats.
* ``node_agent.py`` — ``NodeAgent``: the store, the server, directory publishing and heartbeats,
  hot-unit replication; what the Ray actor ``actors/cache_agent.py`` runs on each node.
* ``cluster_cache.py`` — ``ClusterCache``: what an engine uses instead of an in-process
  ``NodeCache`` when the node has an agent: one directory round trip, then verified loads from
  the local agent and, in parallel, from remote holders; any failure is a miss.

``agent_pb2*.py`` are generated from ``agent.proto`` by ``scripts/gen_proto.sh`` and committed.
"""
