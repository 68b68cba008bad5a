#!/usr/bin/env bash
# Regenerates cachedir/agent/agent_pb2.py and agent_pb2_grpc.py from agent.proto (the generated
# modules are committed, so installing tideserve needs no protoc). Needs grpcio-tools, e.g.
# `.venv/bin/pip install grpcio-tools==1.85.1` (its protoc matches the protobuf runtime pin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. cachedir/agent/agent.proto
echo "regenerated cachedir/agent/agent_pb2.py, cachedir/agent/agent_pb2_grpc.py"
