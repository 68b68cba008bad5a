# The image k8s/rayservice.yaml runs (tideserve:0.1.0), installed by scripts/setup.sh as on any
# machine (without the test dependencies). CPU (the default):
#   docker build -t tideserve:0.1.0 .
# CUDA (torch's CUDA build; the node's driver comes from the NVIDIA container toolkit):
#   docker build --build-arg TORCH_BUILD=cuda -t tideserve:0.1.0-cuda .
FROM python:3.11-slim-bookworm

ARG TORCH_BUILD=cpu
# no package caches in the image
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1 \
    TORCH_BUILD=${TORCH_BUILD} TIDE_EXTRAS=
# g++: setup.sh builds the CPU decode kernels; wget: KubeRay's health probes
RUN apt-get update && apt-get install -y --no-install-recommends g++ wget \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tideserve
COPY . .
RUN scripts/setup.sh && rm -rf /var/lib/apt/lists/*

ENV PATH=/opt/tideserve/.venv/bin:$PATH
# Under KubeRay the pods run `ray start` themselves; alone, the image serves the default model
# until the container stops (every request needs a key: docker run -e TIDE_API_KEYS=KEY:TENANT
# -p 8000:8000 tideserve:0.1.0)
CMD ["sh", "-c", "tide up --host 0.0.0.0 && exec tail -f /dev/null"]
