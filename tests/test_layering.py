"""The one-way import order of the design card, checked by parsing every module (ast).

kernels <- model <- cluster <- actors <- deploy; cachedir imports nothing of ours.
``ray`` only in actors/ and deploy/; ``redis`` only in the directory backend; ``grpc`` only in the
cache agent.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ["kernels", "model", "cachedir", "cluster", "actors", "deploy"]
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "cachedir": set(),
    "cluster": {"kernels", "model", "cachedir"},
    "actors": {"kernels", "model", "cachedir", "cluster"},
    "deploy": {"kernels", "model", "cachedir", "cluster", "actors"},
}
# third-party module -> path prefixes (relative to the repo) allowed to import it
RESTRICTED = {
    "ray": ("actors/", "deploy/"),
    "redis": ("cachedir/directory/redis_backend.py", "cachedir/directory/redis_links.py"),
    "grpc": ("cachedir/agent/",),
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules():
    for pkg in OURS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" not in path.name:
                yield pkg, path


def test_packages_exist():
    assert all((ROOT / pkg / "__init__.py").is_file() for pkg in OURS)


@pytest.mark.parametrize("pkg, path", list(_modules()), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_imports_follow_the_one_way_order(pkg, path):
    rel = str(path.relative_to(ROOT))
    for name in _imports(path):
        top = name.split(".")[0]
        if top in OURS and top != pkg:
            assert top in ALLOWED[pkg], f"{rel} imports {name}: {pkg} may not depend on {top}"
        if top in RESTRICTED:
            assert rel.startswith(RESTRICTED[top]), f"{rel} imports {top}; only {RESTRICTED[top]} may"


def test_the_checker_catches_a_backward_edge(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import deploy.cli\nfrom ray import serve\n")
    assert _imports(bad) == ["deploy.cli", "ray"]
