"""Checkpoints written by every DeepSpeed release tailor-tui reads compose, verify and resume.

For each release, real runs in both layouts (an HF Trainer run, bf16; a DeepSpeed save_dir
run, fp16 with sub-groups, a frozen parameter and its config passed as a file path) are
made with that release (conftest.real_run). `tailor-tui --apply` composes a recipe mixing
two of a run's checkpoints and `--verify` passes; every parameter's fp32 weights, exp_avg
and exp_avg_sq equal its chosen source's (read by DeepSpeed's own zero_to_fp32 code); the
same release resumes from the output, saves exactly what it loaded and takes a finite step.

`pytest` runs the oldest and the newest release (about a minute each on 2 cores);
`make test-compat` (`--deepspeed-releases all`) runs all of them. 0.14.0 to 0.14.3 cannot
be imported beside torch 2.13 (they import `torch.distributed.elastic` helpers torch has
since removed); their save path is the same code as 0.14.4's (docs/formats.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import INSTALLED_DEEPSPEED, OLDEST_DEEPSPEED, checkpoints_of, resume_with, tree_digest
from helpers import (
    assert_optim_states_equal,
    assert_rows_from_picks,
    param_row,
    tailor,
    two_checkpoint_picks,
    write_recipe,
)
from zero_reader import model_states

RELEASES = (OLDEST_DEEPSPEED, "0.15.4", "0.16.9", "0.17.4", "0.18.9", INSTALLED_DEEPSPEED)
RUNS = ("hf_bf16_2", "ds_fp16_2_config_file")


def pytest_generate_tests(metafunc):
    if "release" in metafunc.fixturenames:
        choice = metafunc.config.getoption("deepspeed_releases")
        if choice == "all":
            releases = RELEASES
        elif choice == "ci":
            releases = (RELEASES[0], RELEASES[-1])
        else:
            releases = tuple(choice.split(","))
        metafunc.parametrize("release", releases)






@pytest.mark.parametrize("name", RUNS)
def test_release_composes_verifies_and_resumes(real_run, tmp_path, release, name):
    run, spec = real_run(name, deepspeed=release)
    oldest, _middle, newest = checkpoints_of(run, spec)
    states = model_states(newest)
    assert all(s["ds_version"] == release for s in states)  # really written by that release
    picks = two_checkpoint_picks(spec, oldest)
    recipe = write_recipe(tmp_path, newest, picks)
    before = tree_digest(run)

    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert tree_digest(run) == before, "a source file changed"

    out = tmp_path / "composed"
    assert_rows_from_picks(out, picks, newest)
    if spec.frozen:  # the frozen parameter's row is picked: it must follow its row too
        assert param_row(spec.frozen[0]) in picks

    losses = resume_with(release, out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    resaved = tmp_path / "resume" / "resaved"
    assert_optim_states_equal(out, resaved)
    for mine, theirs in zip(model_states(out), model_states(resaved), strict=True):
        assert mine["ds_version"] == theirs["ds_version"] == release
        for k, v in (mine["frozen_param_fragments"] or {}).items():
            assert torch.equal(v, theirs["frozen_param_fragments"][k])
