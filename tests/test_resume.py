"""Composed checkpoints resume with real DeepSpeed (and the real HF Trainer for HF layouts).

The state DeepSpeed loads from the output, saved again, equals the output bit for bit,
and one more training step gives a finite loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import checkpoints_of
from helpers import assert_optim_states_equal, compose, parity_picks
from zero_reader import model_states

from tailor_tui.runs.demo_run import resume_and_step


@pytest.mark.parametrize("name", ["hf_bf16_2", "hf_fp32_3_tied", "ds_bf16_3_subgroups"])
def test_resume_from_composed_checkpoint(real_run, tmp_path, name):
    run, spec = real_run(name)
    ckpts = checkpoints_of(run, spec)
    out, _ = compose(tmp_path, ckpts, parity_picks(spec, ckpts))

    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)

    resaved = tmp_path / "resume" / "resaved"
    assert_optim_states_equal(out, resaved)
    for mine, theirs in zip(model_states(out), model_states(resaved), strict=True):
        assert mine["global_steps"] == theirs["global_steps"] == spec.steps
        assert mine["frozen_param_fragments"].keys() == theirs["frozen_param_fragments"].keys()
        for k, v in mine["frozen_param_fragments"].items():
            assert torch.equal(v, theirs["frozen_param_fragments"][k])


def test_ranks_are_forked_from_the_import_server_only_in_the_environment_it_started_with(monkeypatch):
    """Ranks are forked from a server that imported torch and DeepSpeed once (`runs.ranks`); a variable
    read at import (such as ATEN_CPU_CAPABILITY) set since it started would not reach them: they are
    then spawned, each importing anew under the environment as it is."""
    from tailor_tui.runs import ranks

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as spawn_ranks sets it before it starts any rank
    assert ranks._start_method() == "forkserver"  # the server of this process, or the one it starts now
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # pytest's, changed for each test: left out
    assert ranks._start_method() == "forkserver"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert ranks._start_method() == "spawn"
    monkeypatch.undo()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert ranks._start_method() == "forkserver"
