"""Accelerate's `save_state()` with the DeepSpeed plugin (ZeRO-3): recognised, composed, resumed.

A real run (2 ranks, Accelerate + DeepSpeed on CPU) saves `checkpoints/checkpoint_0` and
`checkpoint_1`, each with DeepSpeed's tag folder `pytorch_model`, `latest`, `scheduler.bin` and
`random_states_<rank>.pkl`. The scan names each checkpoint by its `checkpoint_N` folder; a recipe
moving rows to the older one is applied through the CLI without a word about other run folders;
the output holds every file `load_state` reads; every parameter and moment is its row's pick;
`accelerator.load_state(output)` resumes (the state it loaded, saved again, is the output's bit
for bit); `--verify` passes, and fails once a copied file is not the base's.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from accelerate_run import resume_accelerate
from conftest import checkpoints_of
from helpers import ComposedCase, assert_optim_states_equal, tailor, write_recipe
from zero_reader import read_full_state

from tailor_tui.checkpoints.scan import scan

PICKS = {"embed_tokens": 0, "layers.1": 0, "lm_head": 0}


@pytest.fixture(scope="module")
def composed(real_run, tmp_path_factory):
    run, spec = real_run("accelerate_ds")
    ckpts = checkpoints_of(run, spec)
    tmp = tmp_path_factory.mktemp("accelerate")
    recipe = write_recipe(tmp, ckpts[-1], {row: ckpts[i] for row, i in PICKS.items()})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    return ComposedCase(spec, ckpts, tmp / "composed", run=run, recipe=recipe, applied=applied)


def test_scan_names_each_save_state_folder(composed):
    run, ckpts = composed.run, composed.ckpts
    result = scan(run)
    assert not result.problems
    assert [c.path for c in result.checkpoints] == ckpts
    assert all(c.kind == "accelerate" and c.tag == "pytorch_model" for c in result.checkpoints)


def test_output_holds_every_file_and_each_rows_pick(composed):
    ckpts, out, applied = composed.ckpts, composed.out, composed.applied
    assert "another run folder" not in applied.stderr
    base = ckpts[-1]
    for f in base.rglob("*"):
        if f.is_file() and "pytorch_model" not in f.relative_to(base).parts:
            assert (out / f.relative_to(base)).read_bytes() == f.read_bytes(), f.name
    assert (out / "scheduler.bin").is_file() and (out / "random_states_1.pkl").is_file()
    got = read_full_state(out)
    states = {c: read_full_state(c) for c in ckpts}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for name, value in got[key].items():
            row = "embed_tokens" if "embed_tokens" in name else "lm_head" if name.startswith("lm_head") \
                else ".".join(name.split(".")[1:3]) if ".layers." in name else "norm"
            source = ckpts[PICKS[row]] if row in PICKS else base
            assert torch.equal(value, states[source][key][name]), (key, name)


def test_load_state_resumes_from_the_output(composed, tmp_path):
    spec, out = composed.spec, composed.out
    losses = resume_accelerate(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_verify_passes_and_fails_on_a_copied_file_not_the_bases(composed, tmp_path):
    ckpts, recipe, out = composed.ckpts, composed.recipe, composed.out
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "scheduler.bin").unlink()
    shutil.copy(ckpts[0] / "scheduler.bin", copy / "scheduler.bin")
    bad = write_recipe(tmp_path, ckpts[-1], {row: ckpts[i] for row, i in PICKS.items()}, output="copy")
    failed = tailor("--verify", bad)
    assert failed.returncode == 7 and "scheduler.bin" in failed.stdout + failed.stderr
