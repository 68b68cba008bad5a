"""``tide train``: a real (short) training run, resumed, stopped by a signal, exported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from model.checkpoint import load_model
from tests.cli import tide_here

SMALL = ["--batch-size", "2", "--seq-len", "64", "--docs-limit", "300", "--checkpoint-every", "2"]


def _done(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])["done"]


def test_train_resume_and_export(tmp_path):
    out = tmp_path / "run"
    r = tide_here("train", "run", "--out", str(out), "--steps", "3", "--json", *SMALL)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if '"step"' in line and "done" not in line]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["loss"] > 0 for row in rows)
    assert _done(r.stdout)["step"] == 3
    first = load_model(out)  # an ordinary HF-format checkpoint
    r = tide_here("train", "run", "--out", str(out), "--steps", "5", "--json", *SMALL)
    assert r.returncode == 0, r.stderr
    done = _done(r.stdout)
    assert done["started_at_step"] == 3 and done["step"] == 5
    second = load_model(out)
    assert not torch.equal(first.embed, second.embed)  # it kept training
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "export", str(out), str(tmp_path / "serve")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    exported = load_model(tmp_path / "serve", dtype="bfloat16")
    torch.testing.assert_close(exported.embed.float(), second.embed, atol=2e-2, rtol=2e-2)


def test_sigterm_checkpoints_and_stops(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "train", "run", "--out", str(out),
                             "--steps", "100000", "--json", *SMALL], stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert json.loads(first)["step"] == 1
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    done = _done(rest)
    assert done["stopped_by_signal"] and done["step"] >= 1
    assert (out / "trainer_state.pt").is_file() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("args, message", [
    (["run", "--out", "x", "--config", "giant"], "'giant'"),
    (["export", "/nonexistent", "y"], "/nonexistent"),
])
def test_bad_arguments_name_the_value(args, message):
    r = tide_here("train", *args)
    assert r.returncode == 2 and message in r.stderr.replace("\n", "").replace("│", "")


@pytest.mark.security
def test_a_planted_trainer_state_is_refused_not_run(tmp_path):
    """Resuming reads the trainer state with torch's weights-only loader: a pickle that would run
    code is an error naming the file, and the code never runs."""
    out = tmp_path / "run"
    r = tide_here("train", "run", "--out", str(out), "--steps", "1", "--json", *SMALL)
    assert r.returncode == 0, r.stderr
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"step": 1, "evil": Planted()}, out / "trainer_state.pt")
    r = tide_here("train", "run", "--out", str(out), "--steps", "2", *SMALL)
    assert r.returncode == 1 and "trainer_state.pt" in r.stderr and "refusing" in r.stderr, r.stderr
    assert not marker.exists()
