"""Composed checkpoints resume with real DeepSpeed (and the real HF Trainer for HF layouts).

The state DeepSpeed loads from the output, saved again, equals the output bit for bit,
and one more training step gives a finite loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import checkpoints_of
from tailor_tui.demo_run import resume_and_step
from test_merge import compose, parity_picks
from zero_reader import model_states, optim_states


def assert_optim_states_equal(out, resaved) -> None:
    """Every rank's fp32 weights, moments and steps in `resaved` equal `out`'s, bit for bit."""
    for mine, theirs in zip(optim_states(out), optim_states(resaved), strict=True):
        for a, b in zip(mine["fp32_flat_groups"], theirs["fp32_flat_groups"], strict=True):
            assert torch.equal(a, b)
        for g, st in mine["optimizer_state_dict"]["state"].items():
            again = theirs["optimizer_state_dict"]["state"][g]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(again[key])), (g, key)


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
