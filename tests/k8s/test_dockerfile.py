"""The image the manifests run: built by scripts/setup.sh (so it installs what a machine gets),
tagged as the manifests and pyproject say, without the build's leftovers. No Docker runs here:
this reads the Dockerfile."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _images() -> set[str]:
    out = set()
    for path in (ROOT / "k8s").glob("*.yaml"):
        out |= set(re.findall(r"image:\s*(tideserve:\S+)", path.read_text()))
    return out


def test_the_image_is_built_by_setup_and_tagged_as_the_manifests_run_it():
    docker = (ROOT / "Dockerfile").read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _images() == {f"tideserve:{version}"}
    assert f"-t tideserve:{version} ." in docker and "--build-arg TORCH_BUILD=cuda" in docker
    runs = " ".join(re.findall(r"^RUN (.+)$", docker, re.M))
    assert "scripts/setup.sh" in runs and "TIDE_EXTRAS=" in docker  # setup's install, no test extras
    assert "ENV PATH=/opt/tideserve/.venv/bin:$PATH" in docker  # `ray start` and `tide` on the PATH
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "TORCH_BUILD" in setup and "TIDE_EXTRAS" in setup  # the switches the Dockerfile sets exist
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)
    assert yaml.safe_load((ROOT / "k8s" / "kustomization.yaml").read_text())  # the manifests still render
