"""No test expects a float that training computed on this CPU.

Training in float32/bf16 on a CPU is not bit-reproducible across machines: torch's vector kernels
round differently (`ATEN_CPU_CAPABILITY=default` runs torch's other kernels on this machine and
shows it). The runs whose numbers the snapshots and the README's samples show are pinned
(tailor_tui/demo/pinned.py): here the demo run is trained again under torch's default kernels, and
every number tailor-tui shows of it, and every tensor it holds, is the same as the cached run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import RUNS_SCRIPT, checkpoints_of
from helpers import tailor
from safetensors.torch import load_file
from zero_reader import read_full_state


def _stats(run) -> dict:
    result = tailor("--stats", run, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.replace(str(run), "RUN"))


def test_a_pinned_run_shows_the_same_numbers_under_torchs_other_kernels(real_run, tmp_path):
    run, spec = real_run("demo")
    assert spec.pinned
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    said = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True)
    assert said.stdout.strip() == "DEFAULT"
    other = tmp_path / "default-kernels"
    made = subprocess.run([sys.executable, str(RUNS_SCRIPT), "make", str(other), spec.key()],
                          env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-4000:]

    assert _stats(other) == _stats(run)  # every loss, grad norm, RMS, Δ, v max and verdict
    for mine, theirs in zip(checkpoints_of(run, spec), checkpoints_of(other, spec), strict=True):
        a, b = read_full_state(mine), read_full_state(theirs)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert a[key].keys() == b[key].keys()
            for name, value in a[key].items():
                torch.testing.assert_close(value, b[key][name], rtol=0, atol=0, equal_nan=True, msg=f"{key} {name}")
        x, y = load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
