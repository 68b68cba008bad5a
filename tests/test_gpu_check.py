"""``scripts/gpu-check.sh --dry-run``: the GPU check's phases, on the CPU in Triton's interpreter
at toy shapes, each within its budget, with one JSON line per case and phase and a verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_lists_its_phases_and_passes_each_within_its_budget(tmp_path):
    r = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=sum(gpu_check.DRY_BUDGETS.values()) + 60, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin",
                                                                         "PYTHON": sys.executable, "HOME": str(tmp_path)})
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["plan"] == [{"phase": p.name, "budget_s": gpu_check.DRY_BUDGETS[p.name]} for p in gpu_check.PHASES]
    phases = {x["phase"]: x for x in lines if "phase" in x and "case" not in x and "budget_s" in x}
    assert set(phases) == {"env", "tests", "kernels", "mtp"}, r.stdout[-3000:]
    for name, phase in phases.items():
        assert phase["ok"] and phase["seconds"] <= phase["budget_s"], (name, phase, r.stdout[-3000:])
    cases = [x for x in lines if "case" in x]
    assert [c["case"] for c in cases] == [c.name for c in gpu_check.CASES] + ["mtp_decode"]
    assert all(c["ok"] and c["seconds"] >= 0 for c in cases), cases
    mtp = cases[-1]  # the default model on the CPU, drafting and not at batch 1
    assert mtp["device"] == "cpu" and mtp["1"]["acceptance_per_position"][0] >= gpu_check.MTP_FLOORS["acceptance"]
    assert mtp["goal"] == {"speedup_at_batch_1": gpu_check.MTP_GOAL, "met": mtp["1"]["speedup"] >= gpu_check.MTP_GOAL}
    assert lines[-1]["verdict"] == "pass" and r.returncode == 0
    assert (tmp_path / "gpu-check.jsonl").read_text().count("\n") == len(lines)
    env = next(x for x in lines if x.get("phase") == "env" and "torch" in x)
    assert env["imports_beyond_torch"] == [] and env["interpreter"]


def test_a_case_fails_on_an_error_over_its_limit_or_an_efficiency_under_its_floor():
    case = gpu_check.Case("c", lambda device, toy: {}, {"max_abs_err": 0.05}, {"fraction_of_peak": 0.4})
    assert gpu_check.failures(case, {"max_abs_err": 0.01, "fraction_of_peak": 0.5}, 1.0) == []
    assert gpu_check.failures(case, {"max_abs_err": 0.2, "fraction_of_peak": 0.5}, 1.0) == ["max_abs_err 0.2 > 0.05"]
    assert gpu_check.failures(case, {"max_abs_err": 0.01, "fraction_of_peak": 0.3}, 1.0) == [
        "fraction_of_peak 0.3 < 0.400"]
    assert gpu_check.failures(case, {"max_abs_err": 0.01, "fraction_of_peak": 0.3}, 0.5) == []  # floors scaled
    assert gpu_check.failures(case, {"max_abs_err": 0.01}, None) == []  # a dry run judges errors only
    assert gpu_check.failures(case, {"fraction_of_peak": 0.9}, 1.0) == ["max_abs_err None > 0.05"]


def test_the_budgets_fit_two_device_calls():
    """The documented split: env, tests and mtp in one call, kernels in another, each well under
    the 600 s a call may run; with a machine's start (minutes) they fit 15 minutes of device time."""
    budget = {p.name: p.budget_s for p in gpu_check.PHASES}
    assert budget["env"] + budget["tests"] + budget["mtp"] <= 330 and budget["kernels"] <= 240
    assert sum(budget.values()) <= 570


def test_phases_can_be_run_alone_and_an_unknown_one_is_named(tmp_path):
    """``--phases``: what a lent GPU's calls split the check into; the plan is only those."""
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)}
    r = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--phases", "env"], cwd=ROOT,
                       capture_output=True, text=True, timeout=gpu_check.DRY_BUDGETS["env"] + 60, env=env)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["plan"] == [{"phase": "env", "budget_s": gpu_check.DRY_BUDGETS["env"]}], r.stdout[-2000:]
    assert lines[-1]["verdict"] == "pass" and r.returncode == 0
    bad = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--phases", "env,gpus"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "gpus" in bad.stderr
