"""The request path stays legible (issue 50's bar), checked by parsing the source (ast): no module
under deploy/ over 350 lines; on the request path no function over 60 lines or of cyclomatic
complexity over 15; no ``cfg.get`` (configs are typed); the ingress's request path Ray-free
but for its Serve adapter and its operational routes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60
MAX_COMPLEXITY = 15
REQUEST_PATH = [
    *sorted((ROOT / "deploy/ingress").glob("*.py")),
    *(ROOT / p for p in ("deploy/openai_api.py", "deploy/protocol.py", "deploy/responses_api.py",
                         "deploy/http_edge.py", "deploy/prefill_router.py", "deploy/decode_router.py",
                         "deploy/request_cost.py", "deploy/prep_pool.py", "cluster/replica.py",
                         "cluster/routing_stats.py", "actors/llm_server.py", "actors/replica_pool.py",
                         "deploy/tidal.py", "cluster/night.py")),
]
RAY_ALLOWED_IN_INGRESS = {"serve_pool.py", "ops.py"}


def complexity(fn: ast.AST) -> int:
    """McCabe's: one plus each branch (if, loop, except, conditional expression, comprehension
    and its conditions, each extra operand of and/or, match case); nested functions count apart."""
    count, stack = 1, list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.If | ast.For | ast.AsyncFor | ast.While | ast.IfExp | ast.ExceptHandler
                      | ast.Assert | ast.match_case):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return count


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", sorted((ROOT / "deploy").rglob("*.py")), ids=_rel)
def test_no_deploy_module_is_over_350_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)} has {lines} lines"


@pytest.mark.parametrize("path", REQUEST_PATH, ids=_rel)
def test_request_path_functions_are_short_and_simple(path):
    for fn in _functions(path):
        lines, cc = fn.end_lineno - fn.lineno + 1, complexity(fn)
        assert lines <= MAX_FUNCTION_LINES, f"{_rel(path)}:{fn.lineno} {fn.name} has {lines} lines"
        assert cc <= MAX_COMPLEXITY, f"{_rel(path)}:{fn.lineno} {fn.name} has complexity {cc}"


def test_configs_are_typed_not_dicts():
    found = [f"{_rel(p)}:{i}" for p in sorted((ROOT / "deploy").rglob("*.py")) + REQUEST_PATH
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bcfg\.get\(", line)]
    assert not found, f"cfg.get in {found}"


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/ingress").glob("*.py")), ids=_rel)
def test_the_ingress_request_path_is_ray_free(path):
    if path.name in RAY_ALLOWED_IN_INGRESS:
        return
    imports = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in imports if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n.split(".")[0] == "ray"], f"{_rel(path)} imports ray"


def test_the_measure_catches_a_branchy_function():
    tree = ast.parse("def f(x):\n    if x and x > 1:\n        return [y for y in x if y]\n    return 0\n")
    assert complexity(tree.body[0]) == 1 + 1 + 1 + 2  # if, and, comprehension with its condition
